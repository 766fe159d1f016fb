"""A target defined outside the package (docs/add_target.md): ``toy_guided``, the toy world under
a guidance scale of its own (``target.cfg_scale``, default 4.5 where the toy's is 3.0), with a
schema of its own. ``python run.py --include examples/target target=toy_guided``."""
from dataclasses import dataclass

from coolsd.worlds.toy import ToyTargetSchema, ToyWorld


@dataclass
class ToyGuidedSchema(ToyTargetSchema):
    cfg_scale: float = 4.5


class ToyGuidedWorld(ToyWorld):
    """The toy world, registered under another name with its own schema and conf file."""

    targets = ("toy_guided",)
    schema = ("toy_guided_schema", ToyGuidedSchema)
