"""An HF Llama-family model rearranged the way vLLM runs it: each decoder layer returns
(hidden_states, residual) and the next layer's fused "add + norm" adds them
(vllm/model_executor/models/llama.py, LlamaDecoderLayer.forward; RMSNorm.forward_native
with a residual). The modules, weights and names are the HF model's, so the two localise
against each other; only the residual convention differs (Engine(convention="vllm")).
A naive per-layer diff of the raw outputs is off by the whole residual stream at every
layer (nnsight #630); the stream, hidden_states + residual, is the same function."""
from __future__ import annotations

import torch
from torch import nn


class VllmStyleLayer(nn.Module):
    def __init__(self, hf_layer):
        super().__init__()
        self.input_layernorm = hf_layer.input_layernorm
        self.self_attn = hf_layer.self_attn
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.mlp = hf_layer.mlp

    def forward(self, positions, hidden_states, residual=None, position_embeddings=None):
        if residual is None:
            residual = hidden_states
        else:
            residual = hidden_states + residual
        h = self.input_layernorm(residual)
        h, _ = self.self_attn(hidden_states=h, attention_mask=None,
                              position_embeddings=position_embeddings)
        residual = h + residual
        h = self.mlp(self.post_attention_layernorm(residual))
        return h, residual


class _Inner(nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        self.embed_tokens = hf_model.model.embed_tokens
        self.layers = nn.ModuleList(VllmStyleLayer(layer) for layer in hf_model.model.layers)
        self.norm = hf_model.model.norm
        self.rotary_emb = hf_model.model.rotary_emb


class VllmStyleLM(nn.Module):
    """forward(input_ids) -> logits [B, L, V]; causal attention through sdpa (no padding)."""

    def __init__(self, hf_model):
        super().__init__()
        hf_model.config._attn_implementation = "sdpa"  # sdpa is causal without a mask
        self.model = _Inner(hf_model)
        self.lm_head = hf_model.lm_head

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("VllmStyleLM runs unpadded sequences only")
        B, L = input_ids.shape
        positions = torch.arange(L).expand(B, L)
        h = self.model.embed_tokens(input_ids)
        pe = self.model.rotary_emb(h, positions)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual, position_embeddings=pe)
        return self.lm_head(self.model.norm(h + residual))
