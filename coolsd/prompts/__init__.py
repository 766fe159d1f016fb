"""Prompt sets: MS-COCO 2017 val longest captions (``coco``); toy prompts live in coolsd.toy."""
from coolsd.prompts.coco import coco_longest_captions, load_coco_prompts

__all__ = ["coco_longest_captions", "load_coco_prompts"]
