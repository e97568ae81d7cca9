"""onepiece: distributed inference for multi-stage AIGC workflows."""
__version__ = "0.1.0"
