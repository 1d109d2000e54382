"""Planning before start-up: what fits a memory budget (fit.py) and which tensor x pipeline layout a
model wants on some GPUs (layout.py). Arithmetic on the model's shape only: no weights, no engine.
"""
