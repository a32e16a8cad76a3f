//! GGUF tensor names (llama.cpp's), in one place for the synthetic-model writer and the reader.
//!
//! Whole-model tensors are constants; a block's tensor is `block(i, ATTN_Q)`, which gives
//! `blk.{i}.attn_q.weight`.

pub const TOKEN_EMBD: &str = "token_embd.weight";
/// gpt2's learned positions.
pub const POSITION_EMBD: &str = "position_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT_NORM_BIAS: &str = "output_norm.bias";
/// The output projection; absent when it is tied to `TOKEN_EMBD`.
pub const OUTPUT: &str = "output.weight";
/// Llama 3's per-dimension RoPE frequency divisors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

// Per-block tensors, to pass to `block`.
pub const ATTN_NORM: &str = "attn_norm.weight";
pub const ATTN_NORM_BIAS: &str = "attn_norm.bias";
pub const ATTN_Q: &str = "attn_q.weight";
pub const ATTN_K: &str = "attn_k.weight";
pub const ATTN_V: &str = "attn_v.weight";
pub const ATTN_Q_BIAS: &str = "attn_q.bias";
pub const ATTN_K_BIAS: &str = "attn_k.bias";
pub const ATTN_V_BIAS: &str = "attn_v.bias";
/// gpt2's fused q|k|v projection.
pub const ATTN_QKV: &str = "attn_qkv.weight";
pub const ATTN_QKV_BIAS: &str = "attn_qkv.bias";
pub const ATTN_OUTPUT: &str = "attn_output.weight";
pub const ATTN_OUTPUT_BIAS: &str = "attn_output.bias";
pub const FFN_NORM: &str = "ffn_norm.weight";
pub const FFN_NORM_BIAS: &str = "ffn_norm.bias";
pub const FFN_GATE: &str = "ffn_gate.weight";
pub const FFN_UP: &str = "ffn_up.weight";
pub const FFN_UP_BIAS: &str = "ffn_up.bias";
pub const FFN_DOWN: &str = "ffn_down.weight";
pub const FFN_DOWN_BIAS: &str = "ffn_down.bias";

/// The full name of block `layer`'s tensor `tensor` (one of the per-block constants).
pub fn block(layer: usize, tensor: &str) -> String {
    format!("blk.{layer}.{tensor}")
}
