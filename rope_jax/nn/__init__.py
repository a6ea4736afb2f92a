"""The network: rotation sites in attention, shared layers, the decoder, decoding.

attention   grouped-query attention with rotation at any subset of q, k, v, o;
            tied key/value (one latent is key and value)
kernels     the softmax-attention step: xla, dot_product, chunked, splash
layers      parameters with logical axes, RMSNorm, SwiGLU MLP
model       the LLaMA-like decoder and its config checks
generate    prefill + key/value-cache decoding
recurrence  VO-RoPE with decaying weights as a linear RNN
"""
