"""MeClear: cooperative-game attribution and verified, query-scoped clearance of harmful retrieved memories.

The library is usable without Ray or a GPU: the game core (`pipeline.game`) is pure numpy over coalition bitmasks,
agents (`pipeline.agents`) answer batches of coalitions, and `pipeline.audit.run` runs a whole audit locally. Only
`pipeline.exec.ray_pool` knows about Ray.
"""

__version__ = "0.1.0"
