"""The other form transformers' modeling files give RoPE (Gemma 4): one
tensor a call, [batch, T, heads, D], q and k in separate calls, q first,
and a KV-shared layer calling it for q alone. tiny_torch.TinyCausalLM
(rotary="single") builds its attention from this module, so that
kvdiff_record.transformers meets the function where transformers puts it:
a module-level apply_rotary_pos_emb of the attention's own module."""

import tiny_torch


def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2, rnd=None):
    """x [batch, T, heads, D] rotated by cos, sin [batch, T, D]."""
    r = rnd or (lambda t: t)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return r(r(x * cos) + r(tiny_torch.rotate_half(x) * sin))


class SingleRopeAttention(tiny_torch.Attention):
    """tiny_torch.Attention with q and k rotated one at a time, in the
    [batch, T, heads, D] layout that form works on."""

    def rotate(self, q, k, cos, sin):
        q = apply_rotary_pos_emb(q.transpose(1, 2), cos[None], sin[None],
                                 rnd=self.prec.rnd).transpose(1, 2)
        if k is not None:
            k = apply_rotary_pos_emb(k.transpose(1, 2), cos[None], sin[None],
                                     rnd=self.prec.rnd).transpose(1, 2)
        return q, k
