#!/usr/bin/env python3
"""hf_deepseek_tool.py: an independent writer, float64 reference and parameter count of Hugging
Face DeepSeek-V3 model directories (DeepseekV3ForCausalLM), in plain Python, for the DeepSeek-V3
import and export test (test_hf_deepseek.sh). The safetensors helpers are hf_llama_tool.py's.

  make DIR [--shards N] [--dtype bf16|f32] [--seed S] [--no-q-lora] [--mtp N]
      A random tiny DeepSeek-V3 as save_pretrained writes it: multi-latent attention (4 heads of
      4 + 2 RoPE features, values of 3, a query latent of 6 (none with --no-q-lora) and a
      key/value latent of 5) with YaRN (x4 over 4 positions, mscale 0.707), layer 0 dense, layers
      1-2 with 8 routed experts in 4 groups (top 2 within the best 2 groups by sigmoid + the
      e_score_correction_bias, renormalized, x2.5) and a shared expert, and N multi-token
      prediction layers after them (model.layers.3...: enorm, hnorm, eh_proj, a layer,
      shared_head; default 1), as DeepSeek's checkpoints hold them.
  greedy DIR PROMPT_IDS NEW
      The greedy continuation by the reference forward (float64, written from Hugging Face's
      modeling_deepseek_v3: interleaved RoPE by permuting then rotating halves, YaRN's
      frequencies and softmax scale, the noaux_tc router), printed as "prompt | new". Exits 3 on a
      near tie (within 1e-3).
  count CONFIG_JSON
      "total active": the parameters of the model config.json describes (Hugging Face's count:
      e_score_correction_bias included, the MTP layers' copies of the embedding and head not),
      and those one token uses.
"""
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama_tool import encode, read_dir, to_floats, write_dir  # noqa: E402


def config(q_lora, mtp, dtype):
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": 100, "hidden_size": 16, "intermediate_size": 24,
            "moe_intermediate_size": 6, "num_hidden_layers": 3, "num_nextn_predict_layers": mtp,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 5,
            "q_lora_rank": q_lora or None, "qk_rope_head_dim": 2, "v_head_dim": 3, "qk_nope_head_dim": 4,
            "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
            "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "aux_loss_alpha": 0.0001, "seq_aux": True,
            "hidden_act": "silu", "max_position_embeddings": 32, "initializer_range": 0.02,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                             "mscale_all_dim": 0.707},
            "attention_bias": False, "attention_dropout": 0.0,
            "torch_dtype": "bfloat16" if dtype == "BF16" else "float32"}


def make(d, shards, dtype, seed, q_lora, mtp):
    rng = random.Random(seed)
    cfg = config(q_lora, mtp, dtype)
    h, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kvr, E, mi = cfg["kv_lora_rank"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    tensors = []

    def add(name, shape, std=0.3, ones=False, values=None):
        n = 1
        for s in shape:
            n *= s
        vals = values or [1.0 + rng.gauss(0, 0.1) if ones else rng.gauss(0, std) for _ in range(n)]
        tensors.append((name, dtype, shape, encode(dtype, vals)))
        return vals

    def mlp(p, width):
        add(p + "gate_proj.weight", [width, h])
        add(p + "up_proj.weight", [width, h])
        add(p + "down_proj.weight", [h, width])

    def layer(p, moe):
        add(p + "input_layernorm.weight", [h], ones=True)
        a = p + "self_attn."
        if q_lora:
            add(a + "q_a_proj.weight", [q_lora, h])
            add(a + "q_a_layernorm.weight", [q_lora], ones=True)
            add(a + "q_b_proj.weight", [H * (dn + dr), q_lora])
        else:
            add(a + "q_proj.weight", [H * (dn + dr), h])
        add(a + "kv_a_proj_with_mqa.weight", [kvr + dr, h])
        add(a + "kv_a_layernorm.weight", [kvr], ones=True)
        add(a + "kv_b_proj.weight", [H * (dn + dv), kvr])
        add(a + "o_proj.weight", [h, H * dv])
        add(p + "post_attention_layernorm.weight", [h], ones=True)
        if not moe:
            mlp(p + "mlp.", cfg["intermediate_size"])
            return
        add(p + "mlp.gate.weight", [E, h], 1.0)
        add(p + "mlp.gate.e_score_correction_bias", [E], 0.05)
        for e in range(E):
            mlp(p + "mlp.experts.%d." % e, mi)
        mlp(p + "mlp.shared_experts.", cfg["n_shared_experts"] * mi)

    emb = add("model.embed_tokens.weight", [V, h], 1.0)
    L = cfg["num_hidden_layers"]
    for l in range(L):
        layer("model.layers.%d." % l, l >= cfg["first_k_dense_replace"])
    add("model.norm.weight", [h], ones=True)
    head = add("lm_head.weight", [V, h], 0.5)
    for k in range(mtp):  # DeepSeek's MTP layers: copies of the embedding and head beside them
        p = "model.layers.%d." % (L + k)
        add(p + "embed_tokens.weight", [V, h], values=emb)
        add(p + "enorm.weight", [h], ones=True)
        add(p + "hnorm.weight", [h], ones=True)
        add(p + "eh_proj.weight", [h, 2 * h])
        layer(p, True)
        add(p + "shared_head.norm.weight", [h], ones=True)
        add(p + "shared_head.head.weight", [V, h], values=head)
    write_dir(d, cfg, tensors, shards)


def logits_of(cfg, w, ids):
    h, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kvr, eps = cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    T = len(ids)
    rs = cfg["rope_scaling"]
    rs = rs or {"factor": 1.0, "original_max_position_embeddings": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 0}
    base, factor = cfg["rope_theta"], rs["factor"]

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    # YaRN's inverse frequencies (transformers' _compute_yarn_parameters) and factors.
    def corr_dim(n):
        return (dr * math.log(rs["original_max_position_embeddings"] / (n * 2 * math.pi))) / (2 * math.log(base))
    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), dr - 1)
    if low == high:
        high += 0.001
    inv = []
    for i in range(dr // 2):
        pos_freq = base ** (2 * i / dr)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extra = 1 - ramp
        inv.append(1.0 / (factor * pos_freq) * (1 - extra) + 1.0 / pos_freq * extra)
    attn_factor = get_mscale(factor, rs["mscale"]) / get_mscale(factor, rs["mscale_all_dim"])
    scale = (dn + dr) ** -0.5 * get_mscale(factor, rs["mscale_all_dim"]) ** 2

    def W(n):
        return w[n][0]

    def linear(x, name, rows):
        m = W(name)
        cols = len(x)
        return [sum(m[r * cols + c] * x[c] for c in range(cols)) for r in range(rows)]

    def rmsnorm(x, name):
        g = W(name)
        s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
        return [x[i] * s * g[i] for i in range(len(x))]

    def rope_interleave(v, t):  # permute (2i, 2i+1) -> (i, i + d/2), then rotate halves
        perm = [v[2 * i] for i in range(dr // 2)] + [v[2 * i + 1] for i in range(dr // 2)]
        out = list(perm)
        for i in range(dr // 2):
            c, s = math.cos(t * inv[i]) * attn_factor, math.sin(t * inv[i]) * attn_factor
            x1, x2 = perm[i], perm[i + dr // 2]
            out[i] = x1 * c - x2 * s
            out[i + dr // 2] = x2 * c + x1 * s
        return out

    def mlp(a, p, width):
        g = linear(a, p + "gate_proj.weight", width)
        u = linear(a, p + "up_proj.weight", width)
        act = [g[i] / (1.0 + math.exp(-g[i])) * u[i] for i in range(width)]
        return linear(act, p + "down_proj.weight", h)

    def moe(a, p):  # noaux_tc: sigmoid, + bias for the choice, the best groups, renormalized
        E, K, G, TG = (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"],
                       cfg["topk_group"])
        z = linear(a, p + "gate.weight", E)
        s = [1.0 / (1.0 + math.exp(-v)) for v in z]
        bias = W(p + "gate.e_score_correction_bias")
        c = [s[e] + bias[e] for e in range(E)]
        per = E // G
        gs = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
        keep = sorted(range(G), key=lambda g: (-gs[g], g))[:TG]
        masked = [c[e] if e // per in keep else 0.0 for e in range(E)]
        top = sorted(range(E), key=lambda e: (-masked[e], e))[:K]
        wts = [s[e] for e in top]
        tot = sum(wts) + 1e-20
        wts = [x / tot * cfg["routed_scaling_factor"] for x in wts]
        y = mlp(a, p + "shared_experts.", cfg["n_shared_experts"] * cfg["moe_intermediate_size"])
        for e, wt in zip(top, wts):
            ye = mlp(a, p + "experts.%d." % e, cfg["moe_intermediate_size"])
            y = [y[i] + wt * ye[i] for i in range(h)]
        return y

    emb = W("model.embed_tokens.weight")
    x = [emb[i * h:(i + 1) * h] for i in ids]
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        a_ = p + "self_attn."
        q, k, v = [], [], []
        for t in range(T):
            a = rmsnorm(x[t], p + "input_layernorm.weight")
            if (a_ + "q_a_proj.weight") in w:
                ql = rmsnorm(linear(a, a_ + "q_a_proj.weight", cfg["q_lora_rank"]), a_ + "q_a_layernorm.weight")
                qt = linear(ql, a_ + "q_b_proj.weight", H * (dn + dr))
            else:
                qt = linear(a, a_ + "q_proj.weight", H * (dn + dr))
            lat = linear(a, a_ + "kv_a_proj_with_mqa.weight", kvr + dr)
            kpe = rope_interleave(lat[kvr:], t)
            kvt = linear(rmsnorm(lat[:kvr], a_ + "kv_a_layernorm.weight"), a_ + "kv_b_proj.weight", H * (dn + dv))
            qs, ks, vs = [], [], []
            for hh in range(H):
                qh = qt[hh * (dn + dr):(hh + 1) * (dn + dr)]
                qs.append(qh[:dn] + rope_interleave(qh[dn:], t))
                kh = kvt[hh * (dn + dv):(hh + 1) * (dn + dv)]
                ks.append(kh[:dn] + kpe)
                vs.append(kh[dn:])
            q.append(qs)
            k.append(ks)
            v.append(vs)
        for t in range(T):
            att = []
            for hh in range(H):
                sc = [sum(q[t][hh][e] * k[u][hh][e] for e in range(dn + dr)) * scale for u in range(t + 1)]
                m = max(sc)
                z = sum(math.exp(si - m) for si in sc)
                o = [0.0] * dv
                for u in range(t + 1):
                    pu = math.exp(sc[u] - m) / z
                    for e in range(dv):
                        o[e] += pu * v[u][hh][e]
                att += o
            y = linear(att, a_ + "o_proj.weight", h)
            x[t] = [x[t][c] + y[c] for c in range(h)]
        for t in range(T):
            a = rmsnorm(x[t], p + "post_attention_layernorm.weight")
            y = moe(a, p + "mlp.") if (p + "mlp.gate.weight") in w else mlp(a, p + "mlp.", cfg["intermediate_size"])
            x[t] = [x[t][c] + y[c] for c in range(h)]
    last = rmsnorm(x[-1], "model.norm.weight")
    head = W("lm_head.weight")
    return [sum(head[r * h + c] * last[c] for c in range(h)) for r in range(V)]


def greedy(d, prompt, new):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    w = {n: (to_floats(dt, raw), shape) for n, (dt, shape, raw) in read_dir(d).items()}
    ids = [int(t) for t in prompt.split()]
    out = []
    for _ in range(new):
        lg = logits_of(cfg, w, ids + out)
        order = sorted(range(len(lg)), key=lambda i: -lg[i])
        if lg[order[0]] - lg[order[1]] < 1e-3:
            print("tie within 1e-3 between ids %d and %d" % (order[0], order[1]), file=sys.stderr)
            sys.exit(3)
        out.append(order[0])
    print(" ".join(map(str, ids)) + " | " + " ".join(map(str, out)))


def count(path):
    with open(path) as f:
        c = json.load(f)
    h, H, V, L = c["hidden_size"], c["num_attention_heads"], c["vocab_size"], c["num_hidden_layers"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c.get("q_lora_rank"), c["kv_lora_rank"]
    attn = (qr * h + qr + H * (dn + dr) * qr) if qr else H * (dn + dr) * h
    attn += (kvr + dr) * h + kvr + H * (dn + dv) * kvr + h * H * dv + 2 * h  # and the two norms
    E, mi, K = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    shared = 3 * h * c["n_shared_experts"] * mi
    moe_total = E * h + E + E * 3 * h * mi + shared  # router, its bias, experts, shared expert
    moe_active = E * h + E + K * 3 * h * mi + shared
    dense = 3 * h * c["intermediate_size"]
    total = active = 2 * V * h + h  # embedding, head (untied), final norm
    for l in range(L):
        sparse = l >= c["first_k_dense_replace"] and l % c.get("moe_layer_freq", 1) == 0
        total += attn + (moe_total if sparse else dense)
        active += attn + (moe_active if sparse else dense)
    for _ in range(c.get("num_nextn_predict_layers", 0)):  # enorm, hnorm, eh_proj, shared_head.norm
        total += attn + moe_total + 3 * h + 2 * h * h
        active += attn + moe_active + 3 * h + 2 * h * h
    print("%d %d" % (total, active))


def main(argv):
    if len(argv) >= 2 and argv[0] == "make":
        opts = {"--shards": "1", "--dtype": "bf16", "--seed": "1", "--mtp": "1"}
        flags = set()
        i = 2
        while i < len(argv):
            if argv[i] == "--no-q-lora":
                flags.add(argv[i])
                i += 1
            else:
                opts[argv[i]] = argv[i + 1]
                i += 2
        make(argv[1], int(opts["--shards"]), opts["--dtype"].upper(), int(opts["--seed"]),
             0 if "--no-q-lora" in flags else 6, int(opts["--mtp"]))
    elif len(argv) == 4 and argv[0] == "greedy":
        greedy(argv[1], argv[2], int(argv[3]))
    elif len(argv) == 2 and argv[0] == "count":
        count(argv[1])
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
