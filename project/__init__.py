"""A PyTorch Lightning project template: multi-GPU training that never loses its run."""
