"""The deep-context adapter: the Kangaroo adapter that also reads the target's deep states of verified positions.

Verification computes the target's final (normed) hidden state ``z_s`` of every accepted position anyway; the
engine hands them to the drafter (:meth:`~kangaroo_core.interfaces.SelfDrafter.observe_deep`). The draft model stays
M[:l] + this adapter + the shared head — no extra target computation.

Glossary (one drafting round that starts after the target emitted x_t):

* ``h_s`` — layer-l state of position s (every position has one);
* ``z_s`` — the target's deep state of position s, known for verified positions s <= t - 1 only (x_t itself was
  produced from z_{t-1}; its own deep state comes with this round's verification);
* draft depth ``j`` — the query at position t + j drafts the (j+1)-th token of the round; the last j + 1 positions
  (t..t+j) have layer-l states only, and the latest deep state is z_{t-1}.

Network (zero-initialised fusions, so an untrained one is exactly the paper's adapter):

    key/value input   y_s = h_s + W_kv z_s   (verified s)        y_s = h_s   (not yet verified)
    query input       x_q = h_q + W_q z_{t-1} + E[j]             (E: a learned embedding of the draft depth)
    out               = norm_out(x_q + Attn(norm_in(x_q), norm_in(y_<=q)))   [+ MLP block], then the head

Training (``forward_depths``) shows it exactly the pattern it meets while drafting: for depth j, query q attends to
fused keys of positions <= q - j - 1 and to plain keys of q - j..q, with z_{q-j-1} in its query — every depth in one
pass over two key sets (fused keys of the verified positions, then plain keys of the round's positions).
"""

from __future__ import annotations

import torch
from torch import nn

from kangaroo_backends.onnx_toolkit import Rotary, rope
from kangaroo_plugins.kangaroo.adapter import KangarooAdapter

#: draft depths beyond this share the last depth embedding
MAX_DEPTH = 8


class DeepContextAdapter(KangarooAdapter):
    """:class:`KangarooAdapter` + deep-state fusion into the verified positions' keys/values and into the query."""

    kind = "deep-context"
    reads_deep_states = True

    def __init__(self, model_config, *, ffn: bool = False, separate_head: bool = False, draft_head: bool = False,
                 exit_layer: int | None = None):
        super().__init__(model_config, ffn=ffn, separate_head=separate_head, draft_head=draft_head,
                         exit_layer=exit_layer)
        d = self.config.hidden_size
        self.kv_fuse = nn.Linear(d, d, bias=False)
        self.query_fuse = nn.Linear(d, d, bias=False)
        self.depth_embedding = nn.Embedding(MAX_DEPTH + 1, d)
        for module in (self.kv_fuse, self.query_fuse, self.depth_embedding):
            nn.init.zeros_(module.weight)
        self.rope = Rotary(self.rotary_emb)
        attn = self.attention
        self.heads, self.kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)  # Gemma 3: query_pre_attn_scalar ** -0.5
        # Qwen3 / Gemma 3 normalise every head's queries and keys before RoPE (the attention module's own norms)
        self.qk_norm = getattr(attn, "q_norm", None) is not None

    # -- the pieces (shared by training, the torch runner and the ONNX graph) --------------------------------------
    def keys_values(self, y: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key/value inputs y [B, n, d] at ``positions`` [n] → keys, values [B, kvh, n, hd] (RoPE applied)."""
        b, n, _ = y.shape
        x = self.input_norm(y)
        k = self.attention.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.attention.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            k = self.attention.k_norm(k)
        cos, sin = self.rope(positions[None])
        return rope(k, cos[:, None], sin[:, None]), v

    def kv_input(self, hidden: torch.Tensor, deep: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """y = h + W_kv z where ``known`` [.., n, 1] (1.0: deep state verified), h elsewhere."""
        return hidden + known * self.kv_fuse(deep)

    def query_input(self, hidden: torch.Tensor, latest_deep: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """x_q = h_q + W_q z_latest + E[depth] (depth clamped to MAX_DEPTH)."""
        return hidden + self.query_fuse(latest_deep) + self.depth_embedding(depth.clamp(0, MAX_DEPTH))

    def queries(self, x_q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Query inputs x_q [B, n, d] at ``positions`` [n] → queries [B, H, n, hd] (RoPE applied)."""
        b, n, _ = x_q.shape
        q = self.attention.q_proj(self.input_norm(x_q)).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q = self.attention.q_norm(q)
        cos, sin = self.rope(positions[None])
        return rope(q, cos[:, None], sin[:, None])

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kvh, T, hd] → [B, H, T, hd] (grouped-query attention)."""
        rep = self.heads // self.kv_heads
        if rep == 1:
            return kv
        b, _, t, hd = kv.shape
        return kv[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd)

    def finish(self, x_q: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, n, hd] → adapter output [B, n, d]: o_proj, residual on x_q, [MLP], norm."""
        b, _, n, _ = attended.shape
        out = x_q + self.attention.o_proj(attended.transpose(1, 2).reshape(b, n, -1))
        if self.ffn:
            out = out + self.mlp(self.mlp_norm(out))
        return self.output_norm(out)

    def attend_all(self, x_q: torch.Tensor, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Drafting: one query x_q [1, 1, d] at ``position`` [1] over every cached key [1, kvh, T, hd] → [1, 1, d].
        Grouped-query heads are matched by a reshape (no copy of the cache) and nothing is masked."""
        return self.finish(x_q, self.attend_one(self.queries(x_q, position), keys, values))

    def attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One query's heads q [1, H, 1, hd] over every cached key [1, kvh, T, hd] → attended [1, H, 1, hd] (the
        part of a draft step that reads a stream's own cache: a merged step runs it stream by stream)."""
        rep = self.heads // self.kv_heads
        q = q.reshape(1, self.kv_heads, rep, self.head_dim).contiguous()  # head h = g * rep + r reads key group g
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling  # [1, kvh, rep, T]
        attended = torch.matmul(torch.softmax(scores, dim=-1), values)  # [1, kvh, rep, hd]
        return attended.reshape(1, self.heads, 1, self.head_dim)

    def attend_biased(self, x_q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
        """The exported graph's attention: queries x_q [1, r, d] at ``positions`` [r] over every key [1, kvh, T, hd],
        plus an additive ``bias`` [1, 1, r, T] (zeros for a chain's one query, a token tree's visibility otherwise).
        Grouped-query heads are matched by a reshape, as in :meth:`attend_all` (which this equals for one query and
        a zero bias) → [1, r, d]."""
        r = x_q.shape[1]
        q = self.queries(x_q, positions)  # [1, H, r, hd]
        rep = self.heads // self.kv_heads
        q = q.reshape(1, self.kv_heads, rep * r, self.head_dim)  # row (g, j, i): head g * rep + j, query i
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling + bias.repeat(1, 1, rep, 1)  # [1, kvh, rep*r, T]
        attended = torch.matmul(torch.softmax(scores, dim=-1), values)  # [1, kvh, rep*r, hd]
        return self.finish(x_q, attended.reshape(1, self.heads, r, self.head_dim))

    def attend_masked(self, x_q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      allowed: torch.Tensor) -> torch.Tensor:
        """Tree drafting: queries x_q [1, m, d] at ``positions`` [m] over the cached keys [1, kvh, T, hd], query i
        reading only the slots ``allowed[i]`` ([m, T] bool: the prefix and its ancestors) → [1, m, d]."""
        q = self.queries(x_q, positions)  # [1, H, m, hd]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, self._expand(keys), self._expand(values), attn_mask=allowed[None, None], scale=self.scaling)
        return self.finish(x_q, attended)

    # -- training: every draft depth in one pass -------------------------------------------------------------------
    def forward_depths(self, hidden: torch.Tensor, deep: torch.Tensor, depths, first_query: int = 0) -> list[torch.Tensor]:
        """hidden, deep [B, T, d] (right-padded; deep of position s = z_s) → one output [B, T, d] per depth j.

        Row q of depth j's output is the draft the adapter makes at query q when z_<=q-j-1 are verified. Rows with
        q - j - 1 < 0 are meaningless (callers mask them out), and so are rows before ``first_query`` (zeros: not
        computed — training skips the prompt's queries, which are never drafted from)."""
        b, t, d = hidden.shape
        positions = torch.arange(t, device=hidden.device)
        ones = torch.ones(b, t, 1, dtype=hidden.dtype, device=hidden.device)
        k_fused, v_fused = self.keys_values(self.kv_input(hidden, deep, ones), positions)
        k_plain, v_plain = self.keys_values(hidden, positions)
        f = min(max(first_query, 0), t - 1)
        outputs = []
        for j in depths:
            lo = max(f, j + 1)  # first query with a verified position before its round (earlier rows stay zero)
            if lo >= t:
                outputs.append(hidden.new_zeros(b, t, d))
                continue
            queries = positions[lo:]
            latest = deep[:, lo - j - 1: t - j - 1]  # z_{q-j-1}
            depth = torch.full((b, t - lo), j, dtype=torch.long, device=hidden.device)
            x_q = self.query_input(hidden[:, lo:], latest, depth)
            # keys: fused ones of positions <= t - j - 2 (the latest any query here has verified), then plain ones of
            # positions >= lo - j (the earliest round start here): the plain keys of the prompt are never read
            fused_end, plain_start = t - j - 1, lo - j
            keys = torch.cat([k_fused[:, :, :fused_end], k_plain[:, :, plain_start:]], dim=2)  # [B, kvh, Tk, hd]
            values = torch.cat([v_fused[:, :, :fused_end], v_plain[:, :, plain_start:]], dim=2)
            q_pos = queries[:, None]
            verified = positions[None, :fused_end] <= q_pos - j - 1  # fused keys of verified positions
            plain = positions[None, plain_start:]
            recent = (plain >= q_pos - j) & (plain <= q_pos)  # the round's positions so far: layer-l only
            allowed = torch.cat([verified, recent], dim=1)  # [Tq, Tk]
            # one fused attention kernel over both key sets (PyTorch's SDPA: far less memory traffic than masked
            # matmuls on the long prompts training sees); grouped-query heads read their key group in the kernel
            attended = torch.nn.functional.scaled_dot_product_attention(self.queries(x_q, queries), keys, values,
                                                                        attn_mask=allowed, scale=self.scaling,
                                                                        enable_gqa=self.heads != self.kv_heads)
            outputs.append(torch.cat([hidden.new_zeros(b, lo, d), self.finish(x_q, attended)], dim=1))
        return outputs
