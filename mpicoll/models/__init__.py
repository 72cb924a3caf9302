"""Models over one flat parameter vector: numpy's dense models (softmax, MLP, CNN) and torch
modules pointed at the same vector."""
