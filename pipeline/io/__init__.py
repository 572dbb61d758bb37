"""Input loaders (memory pools, query sets, LoCoMo, mem0). Inputs are only ever opened for reading; the run folder
is `pipeline.store`."""
