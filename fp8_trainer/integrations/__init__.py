"""fp8scope beside the runtimes and trainers people already use.

* ``torchao``: watch a model converted by ``torchao.float8.convert_to_float8_training`` (``Monitor`` does it
  by itself when it finds torchao's ``Float8Linear`` layers);
* ``transformer_engine``: read Transformer Engine 2.x modules' own amax histories and scales (``Monitor``
  does it by itself when it finds them);
* ``hf``: ``Fp8ScopeCallback`` for the Hugging Face ``Trainer``;
* ``lightning``: ``Fp8ScopeCallback`` for Lightning.

Each module imports its library only when used.
"""
