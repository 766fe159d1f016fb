"""Relaxation by price: each node's G* relaxation chosen from its own p and q (docs/methods.md#21-relaxation-by-budget)."""
from coolsd.engine.decoding.rules import BudgetRule
from coolsd.engine.methods.registry import Param, register_method


@register_method("budget", lossless=lambda p: p["price"] is None, params={
    "price": Param(2.0, float, low=0, nullable=True,
                   doc="accepted tokens given up per unit of distortion (lambda); null: infinite, lossless"),
    "cost": Param("kl", str, choices=("kl", "tv"), doc="the node's distortion the price is paid on"),
})
def budget(ctx, price, cost):
    """At every node, a = omega p_res with the omega that maximises the node's acceptance
    probability minus ``price`` times the KL (or TV) of the distribution it emits."""
    return BudgetRule(price, cost), None
