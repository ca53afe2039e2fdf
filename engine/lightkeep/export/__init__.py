"""Export (the ``export`` extra: ``pip install -e ".[export]"``): a checkpoint's model in the formats people deploy
(``formats.export``: safetensors, ONNX, ``torch.export``, pickled module), and a model in one ``.safetensors`` file
with the recipe to build it (``weights.load_net``). ``scripts/export.py`` is its command line; training never
imports it.
"""
