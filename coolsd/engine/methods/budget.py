"""Relaxation by price: each node's G* relaxation chosen from its own p and q (docs/methods.md#21-relaxation-by-budget)."""
from coolsd.engine.decoding.rules import BudgetRule
from coolsd.engine.methods.registry import Param, register_method, require


def _lossless(p) -> bool:
    return p["price"] is None or p["tv_per_image"] == 0


def _budget_needs_a_price(p) -> None:
    if p["tv_per_image"] and p["price"] is None:
        raise ValueError("budget: tv_per_image tunes the price from a starting value; give price a number")


def _eager_price_tuning(params, cfg, world_cls) -> None:
    """``tv_per_image`` changes the price between batches: eager runs only (the config check,
    ``register_method(config_checks=...)``)."""
    if cfg.get("compile", False) and params.get("tv_per_image"):
        raise ValueError("method.tv_per_image tunes the price between batches, which the compiled graphs would "
                         "bake in: set compile=false")


@register_method("budget", lossless=_lossless, checks=(_budget_needs_a_price,), config_checks=(_eager_price_tuning,),
                 params={
    "price": Param(2.0, float, low=0, nullable=True,
                   doc="accepted tokens given up per unit of distortion (lambda); null: infinite, lossless; "
                       "with tv_per_image: the starting price"),
    "cost": Param("kl", str, choices=("kl", "tv"), doc="the node's distortion the price is paid on"),
    "tv_per_image": Param(None, float, low=0, nullable=True,
                          doc="tune the price over the run's images to this summed step TV per image (0: lossless)"),
    "rate": Param(0.2, float, low=0, low_open=True, doc="the controller's step in log price per unit of relative excess"),
})
def budget(ctx, price, cost, tv_per_image, rate):
    """At every node, a = omega p_res with the omega that maximises the node's acceptance
    probability minus ``price`` times the KL (or TV) of the distribution it emits; ``tv_per_image``
    tunes the price image by image to that budget."""
    if tv_per_image:
        require(ctx.tree is None or max(ctx.tree.level_max_children, default=1) <= 1,
                "budget tv_per_image reads each image's summed step TV, which only chains have: use tree=chain")
    return BudgetRule(price, cost, tv_per_image=tv_per_image, rate=rate), None
