"""Model families: for each, a torch-free description (what it makes, its geometry, its limits:
models/family.py, models/limits.py) beside its adapter (models/<family>/adapter.py: everything a
worker does differently for it). models/registry.py picks the family of a model directory once;
models/tiny.py builds the embedded tiny models offline."""
