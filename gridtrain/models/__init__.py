"""The models: one decoder-only transformer of either architecture.

* ``decoder``: :class:`Decoder` (GPT-2 or Llama blocks, embedding, head, loss, key/value
  cache, generation), layout-independent initialisation, FLOP and parameter counts;
* ``attention``: self-attention (SDPA or op-by-op math, grouped-query heads, rotary);
* ``llama``: the Llama block's pieces (RMSNorm, rotary positions, SwiGLU);
* ``mtp``: multi-token prediction (DeepSeek-V3's modules after the last block, training only);
* ``hf_mapping``: the rules between gridtrain's parameter names and Hugging Face's.

Models are built from ``parallel``'s layers; they may import ``parallel``, ``runtime``,
``memory`` and ``config``, never the optimizer, checkpoints or the training loop.
"""
