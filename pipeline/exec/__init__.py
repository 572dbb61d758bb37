"""Worker pools: the pool contract, in process and on Ray (generic: no audit code), and the prefetch thread."""
