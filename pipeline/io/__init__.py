"""Input loaders (memory pools, query sets, LoCoMo) and output writers. Inputs are only ever opened for reading."""
