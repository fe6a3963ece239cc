"""The GPU engine for models larger than the GPU: dense weights in VRAM, experts tiered.

Every routed expert has a blob in page-locked host RAM; a fixed set of VRAM slots caches
some of them. A per-(layer, expert) address table on the device says where each blob is.
A decode step gets its misses by `gpu_miss`: "copy" (a fetch kernel copies the missed blobs
into VRAM staging, then the fused MoE kernel reads VRAM only) or "in_place" (the fused
kernel reads the host copy over PCIe itself).

The forward takes a batch (`stratad.engine.batch`): B sequences, each with its own KV
cache and new tokens. A decode step runs one token per sequence through all layers with no
host synchronisation (routing ids stay on the device), captured as a CUDA graph per set of
caches; the routed experts of all B tokens are read once per step. While the next step
runs, a per-layer LRU policy moves recently used experts into VRAM on a side stream, and
only then repoints the table.
With `pcie_frac` below 1, part of each step's misses is computed on the CPU from its RAM
copy while the GPU takes the rest: the step runs as two captured pieces per layer with the
host's turn between them (`split_step`).
Prefill runs in chunks: each layer's routed experts are copied into a staging area while
the previous layer computes, dequantized to the compute dtype, and run as grouped GEMMs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as fn

from kernels.experts.expert_fetch import fetch_experts
from kernels.experts.link_pace import pace_link
from kernels.experts.moe import GluClamp, moe_down, moe_gate_up, pair_biases
from kernels.experts.router import route_topk
from kernels.layers.linear import MAX_TOKENS, decode_linear
from kernels.layers.norm import MAX_FUSED_D, add_parts, add_rmsnorm, rmsnorm
from stratad.engine.batch import Seq, decode_inputs, run_ahead, run_batch
from stratad.engine.expert_ffn import ExpertFfn
from stratad.engine.kv import KVCache, KVPool
from stratad.engine.offload.attention import OffloadAttention
from stratad.engine.offload.config import OffloadConfig, kv_pool
from stratad.engine.offload.cpu_misses import CpuMisses, expert_math
from stratad.engine.offload.decode_graph import SIZES, DecodeGraph
from stratad.engine.offload.dense import DenseLayer, dense_layers
from stratad.engine.offload.experts import kernel_layouts
from stratad.engine.offload.kernel_form import KernelForm
from stratad.engine.offload.linear_attention import OffloadDeltaNet
from stratad.engine.offload.prefetch import ExpertPrefetch
from stratad.engine.offload.projection import GgufMatrix, gguf_matrix, gguf_rows
from stratad.engine.offload.split_step import SplitParts, SplitStep
from stratad.engine.offload.staging import ExpertStaging
from stratad.engine.passes import FETCH_MAX_TOKENS, FUSED_MAX_TOKENS, Decode, Pass
from stratad.engine.reference.layers import rms_norm, route, route_as, swiglu
from stratad.engine.timing import StageTimer
from stratad.host_copy import to_device
from stratad.model.graph.activation import ClampedSwiGlu
from stratad.model.spec import Model, ModelError
from stratad.store.addressed import AddressedStore
from stratad.store.tiers.address_table import AddressTable
from stratad.store.tiers.rows import PinnedRows, gpu_lock
from stratad.store.tiers.slots import initial_residents
from stratad.store.tiers.sources import ModelExperts

log = logging.getLogger("stratad.engine")


class OffloadForward:
    """Forward pass of a MoE model on one GPU with experts tiered between VRAM and RAM."""

    def __init__(
        self,
        model: Model,
        device: torch.device,
        config: OffloadConfig,
        store: AddressedStore | None = None,
        residents: list[list[int]] | None = None,
        layers: range | None = None,
        ram: list[list[int]] | None = None,
    ) -> None:
        """`store`: the experts' tiers (the plan's RAM rows in the kernels' form, page-locked
        for the GPU; None: every expert's, read from the model, `ram` aside). `residents`: each
        layer's experts that start in VRAM (e.g. from the store's residency plan); by default
        an even share of `config.expert_vram_bytes`. `ram`: each layer's experts with a RAM
        copy where no `store` is given (None: every expert), the others are read from the file
        when routed. `layers`:
        the layers this engine runs (a pipeline stage, see `stratad.engine.offload.stages`); the
        first stage embeds, the last computes the logits."""
        spec = self.spec = model.spec
        self.layer_ids = layers if layers is not None else range(spec.n_layers)
        if not spec.is_moe:
            raise ModelError(f"{model.source}: the offload engine serves MoE models")
        if spec.deltanet is not None and self.layer_ids != range(spec.n_layers):
            raise ModelError(f"{model.source}: a recurrent model's layers run on one GPU (its"
                             " state is handed over whole at the end of a pass)")  # fmt: skip
        # the store's grid is the routed layers: model layer i is its row i - first_moe (a
        # leading dense layer has none)
        self.first_moe = d = spec.dense_layers
        self.rows = range(max(self.layer_ids.start - d, 0), max(self.layer_ids.stop - d, 0))
        if not self.rows:
            raise ModelError(f"{model.source}: layers {self.layer_ids.start}.."
                             f"{self.layer_ids.stop - 1} route to no experts")  # fmt: skip
        self.layouts = kernel_layouts(model, config.q6_k_split)
        self.device, self.config, self.dtype = device, config, config.dtype
        # the RAM tier pins on its own thread while the dense weights load
        if store is None:
            source = ModelExperts(model)
            rows = PinnedRows(source, KernelForm(source.layouts, self.layouts), ram,
                              gpu_lock(device))  # fmt: skip
            store = AddressedStore(rows)
        self.store, self.ram = store, store.rows
        held = self.ram.form
        if not (isinstance(held, KernelForm) and held.layouts == self.layouts):
            raise ValueError("the RAM tier holds the experts in other layouts than the kernels"
                             " read (OffloadConfig.q6_k_split)")  # fmt: skip
        # one Triton kernel per norm on a GPU (the torch reference is six launches)
        self.norm_fn = rmsnorm if device.type != "cpu" else rms_norm
        # softmax, top-k and renormalisation in one kernel (torch: six launches per layer),
        # where the model routes so (`Routing.as_softmax`; else torch, `route_as`)
        self.route_fn = route_topk if device.type != "cpu" else route
        self.softmax_norm = spec.routing.as_softmax(spec.norm_topk_prob)
        act = spec.activation  # gpt-oss's clamped SwiGLU, as the fused kernels compute it
        self.clamp = GluClamp(act.alpha, act.limit) if isinstance(act, ClampedSwiGlu) else None
        # the CPU's share of misses computes routed layers' experts (kernels.cpu.experts:
        # SiLU or the clamped SwiGLU, with the experts' biases); the split step walks routed
        # layers alone
        self.cpu_refusal = f"its first {d} layers are dense" if d else None
        if self.cpu_refusal is not None and config.pcie_frac < 1.0:
            raise ModelError(f"{model.source}: the CPU's share of the misses walks routed layers"
                             f" alone, and {self.cpu_refusal}: keep engine.pcie_frac at"
                             " 1")  # fmt: skip
        # decode's projections read their weights near HBM's rate in a GEMV kernel (cuBLAS's
        # M = 1 path reached about a third of it on an H200); prefill's chunks stay GEMMs
        self.gemv = device.type != "cpu" and self.dtype in (torch.float16, torch.bfloat16)
        self.layers = dense_layers(model, device, self.dtype, self.layer_ids, config.dense_gguf)
        first, last = self.layer_ids.start == 0, self.layer_ids.stop == spec.n_layers

        def weight(name: str) -> torch.Tensor:
            return model.tensor(name).dequantize(self.dtype).to(device)

        empty = torch.empty(0, device=device)
        self.embed = weight("model.embed_tokens.weight") if first else empty
        self.norm = weight("model.norm.weight") if last else empty
        head = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        blocks = (gguf_matrix([gguf_rows(model.tensor(head))], device)
                  if last and config.dense_gguf else None)  # fmt: skip
        self.lm_head: torch.Tensor | GgufMatrix = (
            blocks if blocks is not None
            else (self.embed if first and spec.tie_embeddings else weight(head)) if last
            else empty
        )  # fmt: skip
        self.ram.wait()
        if device.type == "cuda" and not self.ram.gpu_registered:
            raise ValueError(
                "the GPU engine reads its RAM tier in place: build its PinnedRows"
                " with a lock that registers them with the GPU (gpu_lock)"
            )
        self.experts = self._init_table(residents)
        self.side = self.experts.side
        self._init_fetch()
        self.attention = OffloadAttention(spec, device, config, self.linear, self.norm_fn)
        self.deltanet = (  # Qwen3-Next's linear-attention layers
            OffloadDeltaNet(spec.deltanet, [i for i in self.layer_ids if spec.linear_layer(i)],
                            spec.rms_eps, self.linear, self.norm_fn, device)
            if spec.deltanet is not None else None
        )  # fmt: skip
        self.timer = StageTimer(enabled=False)
        self.staging = ExpertStaging(self.experts, self.layouts, self.dtype,
                                     config.kernels.dequant, spec.activation)  # fmt: skip
        biases = {i - d: (b[0].cpu(), b[1].cpu()) for i, w in self.layers.items()
                  if (b := w.expert_bias) is not None}  # by the store's row  # fmt: skip
        ffn = ExpertFfn(biases, spec.activation)
        self.cpu = CpuMisses(self.experts, self.layouts, spec.hidden,
                             expert_math(config.cpu_kernels, config.cpu_threads), ffn)  # fmt: skip
        # guesses need the copy path's staging (none when every expert is in VRAM: nothing to
        # guess) and no file tier (its experts have no address to copy from before the step)
        guess = config.prefetch and self._fetch_buf.shape[0] > 0 and not self.experts.reads_file
        self.prefetch = ExpertPrefetch(self.experts, self.layouts, self._guess_route,
                                       spec.n_experts_used, config.kernels.prefetch,
                                       self._host_span, guess)  # fmt: skip
        # a batched step reads and writes every cache through the block tables (a recurrent
        # model's states through the address table its `begin` fills): one capture per batch
        # size serves every set of caches of the pool
        net = self.deltanet

        def by_table(caches: Sequence[KVCache]) -> bool:
            return self.attention.batched(caches) and (net is None or net.rows > 0)

        preserve = self.deltanet.preserved if self.deltanet is not None else nullcontext
        self.graph = DecodeGraph(self._decode_pass, device, by_table, preserve)
        self.split = SplitStep(self._split_parts(), device, config.graphs, preserve)

    # -- placement -----------------------------------------------------------------------

    def _init_table(self, residents: list[list[int]] | None) -> AddressTable:
        """The VRAM slots and the address table (the store's); each of this engine's layers
        owns the slots its initial residents fill (the plan's choice, or an even share of the
        budget by expert index)."""
        spec, nbytes, own = self.spec, self.layouts.slot_bytes, self.rows
        if residents is None:
            per_layer = min(spec.n_experts, self.config.expert_vram_bytes // nbytes // len(own))
            residents = initial_residents(len(spec.moe_layers), spec.n_experts, per_layer)
        # the file tier: this engine's experts with neither a RAM copy nor a slot held for good
        # (a resident without a RAM copy is never evicted)
        file_only = any(
            not self.ram.has(layer, x) and x not in residents[layer]
            for layer in own for x in range(spec.n_experts)
        )  # fmt: skip
        # distinct experts: at most a layer's, at most the pairs of the longest fused pass
        rows = min(FUSED_MAX_TOKENS * spec.n_experts_used, spec.n_experts) if file_only else 0
        return self.store.address_table(own, residents, self.device, self.config.slots, rows)

    def _init_fetch(self) -> None:
        """VRAM staging for the missed experts of a fused pass of up to FETCH_MAX_TOKENS tokens
        (the copy miss path; a row per (token, slot), filled for the first pair of each
        missed expert)."""
        nbytes, pairs = self.layouts.slot_bytes, self.spec.n_experts_used * FETCH_MAX_TOKENS
        self._host_span = self.ram.span
        # every blob (host rows start on pages, VRAM slots and staging rows on 16 bytes) and
        # every projection in it starts on 16 bytes: the kernels may load 16 bytes at a time
        self._aligned = self.layouts.offsets_aligned and self._host_span[0] % 16 == 0
        if self.config.q6_k_split and not self._aligned:
            raise ModelError(f"{self.spec.arch}: q6_k_split needs every projection on 16 bytes"
                             " (the int8 dots read the split layout alone)")  # fmt: skip
        nothing_to_miss = self.experts.complete
        copy = self._aligned and self.config.gpu_miss == "copy" and not nothing_to_miss
        rows = pairs if copy else 0
        self._fetch_buf = torch.zeros((rows, nbytes), dtype=torch.uint8, device=self.device)

    def _split_parts(self) -> SplitParts:
        """The pieces of a decode step with a CPU share (`split_step`)."""
        return SplitParts(
            self.layer_ids, self.spec.n_experts_used, self.spec.hidden,
            embed=lambda tok: self.embed[tok], begin=self.attention.begin_decode,
            attend_route=lambda i, x, parts, pos, caches: self._attend_route(
                i, x, parts, pos, caches, Decode(len(caches))),
            gpu_experts=lambda i, h, ids, w: self._with_shared(
                i, h, self.gpu_experts(i, h, ids, w)),
            finish=lambda x, parts: self.head(add_parts(x, parts)),
            cpu_slots=lambda i, ids: self.cpu.slots(i, ids, self.config.pcie_frac),
            cpu_compute=self.cpu.compute, stage=lambda name: self.timer.stage(name),
        )  # fmt: skip

    def _guess_route(self, row: int, x: torch.Tensor) -> torch.Tensor:
        """The experts [1, k] int32 that the router of the store's `row` picks for the hidden
        state x [1, H] as it stands (the prefetch's guess)."""
        w = self.layers[row + self.first_moe]
        return self._route(w, self.norm_fn(x, w.ffn_norm, self.spec.rms_eps))[1]

    def new_pool(self, tokens: int) -> KVPool:
        """A KV pool of at least `tokens` rows on this engine's device (`config.kv_pool`)."""
        return kv_pool(self.spec, tokens, [self.device] * self.spec.n_layers, self.config)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """A cache of `max_len` tokens (the context) on a pool of its own."""
        n = max_len or self.config.max_context
        return KVCache(self.new_pool(n), n)

    # -- one layer ------------------------------------------------------------------------

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | GgufMatrix, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] @ weight^T (+ bias): the decode GEMV for a few tokens (int8 dots over GGUF
        blocks where the weight is held so), else torch (GEMMs over dequantized slices)."""
        kernels, rows = self.config.kernels, x.shape[0]
        if isinstance(weight, GgufMatrix):
            if rows <= min(kernels.qlinear.max_tokens, MAX_TOKENS):
                out = weight(x, kernels.qlinear)
            else:
                out = weight.dequantized(x)
            return out if bias is None else out + bias
        gemv = self.gemv and weight.stride(1) == 1
        if gemv and rows <= min(kernels.linear.max_tokens, MAX_TOKENS):
            return decode_linear(x, weight, bias, kernels.linear)
        return fn.linear(x, weight, bias)

    def _route(self, w: DenseLayer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] float32, expert ids [T, k] int32) of the normed h [T, H]."""
        spec = self.spec
        assert w.router is not None, "a dense layer routes to no experts"
        if self.softmax_norm is None:  # e.g. sigmoid scores with a correction bias
            weights, ids = route_as(spec, self.linear(h, w.router), w.router_bias)
            return weights, ids.to(torch.int32)
        logits = self.linear(h, w.router)
        if w.router_bias is not None:  # float32, as the routing adds it (gpt-oss)
            logits = logits.float() + w.router_bias
        weights, ids = self.route_fn(logits, spec.n_experts_used, self.softmax_norm)
        if spec.expert_scale != 1.0:
            weights = weights * spec.expert_scale
        return weights, ids.to(torch.int32)  # the kernels read int32 ids

    def _shared(self, w: DenseLayer, h: torch.Tensor) -> torch.Tensor | None:
        if w.shared is None:
            return None
        s = swiglu(h, *w.shared)
        if w.shared_gate is not None:
            s = s * torch.sigmoid(self.linear(h, w.shared_gate))
        return s

    def _add_norm(
        self, x: torch.Tensor, parts: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream x [T, H] plus the previous block's parts [T, P, H] (None: nothing to
        add), and its norm with `weight`: one kernel on a GPU."""
        eps = self.spec.rms_eps
        if parts is None:
            return x, self.norm_fn(x, weight, eps)
        if self.device.type != "cpu" and x.shape[-1] <= MAX_FUSED_D:
            return add_rmsnorm(x, parts, weight, eps)
        x = add_parts(x, parts)
        return x, rms_norm(x, weight, eps)

    def _layer(
        self,
        i: int,
        x: torch.Tensor,
        parts: torch.Tensor | None,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        step: Pass,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer i on the stream x [T, H] once the previous layer's `parts` are added to it:
        (the stream after attention, this layer's parts [T, P, H] still to add, its routed
        ids: None for a leading dense layer). Each residual add is fused with the norm that
        follows it."""
        stage, w = self.timer.stage, self.layers[i]
        if w.ffn is not None:  # a leading dense layer: its feed-forward block in VRAM
            x, h = self._attend(i, x, parts, pos, caches, step)
            with stage("dense feed-forward"):
                return x, swiglu(h, *w.ffn)[:, None], None
        x, h, weights, ids = self._attend_route(i, x, parts, pos, caches, step)
        row = i - self.first_moe
        if step.fused:
            self.experts.read_file_misses(row, ids)
        if step.fused and self.config.pcie_frac < 1.0:
            parts = self.cpu.run(row, h, ids, weights, self.config.pcie_frac, self.gpu_experts,
                                 self.timer)  # fmt: skip
        elif step.fused:
            parts = self.gpu_experts(row, h, ids, weights)
        else:
            with stage("experts (staged)"):
                parts = self.staging.moe(row, h, ids, weights, w.expert_bias)[:, None]
        return x, self._with_shared(i, h, parts), ids

    def _attend(
        self,
        i: int,
        x: torch.Tensor,
        parts: torch.Tensor | None,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        step: Pass,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention block: (the stream after it, its feed-forward norm h)."""
        w, stage = self.layers[i], self.timer.stage
        with stage("attention"):
            x, h = self._add_norm(x, parts, w.attn_norm)
            if w.deltanet is not None and self.deltanet is not None:
                attn = self.deltanet(w, i, h, step, caches)
            else:
                attn = self.attention(w, i, h, pos, caches, step)
        return self._add_norm(x, attn[:, None], w.ffn_norm)

    def _attend_route(
        self,
        i: int,
        x: torch.Tensor,
        parts: torch.Tensor | None,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        step: Pass,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to its routing: (the stream after attention, its norm h, the routing
        weights and ids [T, k])."""
        x, h = self._attend(i, x, parts, pos, caches, step)
        with self.timer.stage("router"):
            weights, ids = self._route(self.layers[i], h)
        if step.tokens == 1:
            with self.timer.stage("expert prefetch"):  # guess the next row's
                self.prefetch.after_route(i - self.first_moe, x, ids, self.config.pcie_frac)
        return x, h, weights, ids

    def _with_shared(self, i: int, h: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """The routed parts [T, P, H] and the shared expert's output, if the model has one."""
        with self.timer.stage("shared expert"):
            shared = self._shared(self.layers[i], h)
        if shared is None:
            return parts
        return torch.cat([parts, shared[:, None].to(parts.dtype)], dim=1)

    def gpu_experts(
        self, i: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts of the store's row i on the GPU for a few tokens (slots with a
        negative id are skipped): hits from their VRAM slots, misses by the configured path.
        Each slot's weighted output, [T, k, H] float32 (the next `_add_norm` sums them)."""
        stage, table = self.timer.stage, self.prefetch.table(i)
        name = "experts (VRAM + in place)"
        # biases by the table's rows: the experts' own, or gathered by pair for a fetch's
        bias = self.layers[i + self.first_moe].expert_bias
        gate_up_bias, down_bias = bias if bias is not None else (None, None)
        if ids.numel() <= self._fetch_buf.shape[0]:
            if bias is not None:  # (before ids become the fetch's rows)
                gate_up_bias, down_bias = pair_biases(bias, ids)
            with stage("experts (PCIe fetch)"):
                span, buf, cfg = self._host_span, self._fetch_buf, self.config.kernels.fetch
                if self.config.link_wait_ns_per_blob:  # a benchmark's slower link
                    pace_link(ids, table, span, self.config.link_wait_ns_per_blob)
                ids, table = fetch_experts(ids, table, span, buf, self.layouts.copy_bytes(i), cfg)
            name = "experts (VRAM)"
        with stage(name):
            kernels, aligned, fmt = self.config.kernels, self._aligned, self.layouts[i].fmt
            gate_up = kernels.moe_for("moe", fmt.gate, fmt.held_split(fmt.gate))
            down = kernels.moe_for("moe_down", fmt.down, fmt.held_split(fmt.down))
            act = moe_gate_up(h.contiguous(), ids, table, self.spec.expert_ffn, gate_up, aligned,
                              fmt, gate_up_bias, self.clamp)  # fmt: skip
            return moe_down(act, ids, weights, table, self.spec.hidden, down, aligned, fmt,
                            down_bias)  # fmt: skip

    @property
    def tables(self) -> list[AddressTable]:
        return [self.experts]

    @property
    def route_counts(self) -> torch.Tensor:
        """[L, E] routed experts counted per decode step (the profile the store plans from)."""
        return self.experts.route_counts

    def set_pcie_frac(self, frac: float) -> None:
        if frac < 1.0 and self.cpu_refusal is not None:
            log.warning("engine.pcie_frac stays 1: the CPU's share of the misses walks routed"
                        " layers alone, and %s", self.cpu_refusal)  # fmt: skip
            return
        self.config = replace(self.config, pcie_frac=frac)

    def measure_cpu_expert_bps(self) -> float:
        return self.cpu.measure_bps()

    @property
    def cpu_math(self) -> str:
        """How the CPU computes its misses (compiled kernels or torch)."""
        return self.cpu.math.name

    # -- the passes -----------------------------------------------------------------------

    @property
    def prefill_chunk(self) -> int:
        return self.config.prefill_chunk

    def run(
        self, tokens: list[int], pos: list[int], caches: Sequence[KVCache], step: Pass
    ) -> torch.Tensor:
        """Hidden states [T, H] of a pass after this engine's layers (see `batch.Layers`)."""
        device = self.device
        with self._recurrent(caches, [r.stop - r.start for r in step.rows()]):
            x = self.embed[to_device(tokens, torch.long, device)]
            x, _ = self.run_layers(x, to_device(pos, torch.long, device), caches, step)
        return x

    @contextmanager
    def _recurrent(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> Iterator[None]:
        """A pass over `caches` (their `tokens` new ones each): a recurrent model's states
        taken off them for it and given back after it (`linear_attention`), outside any
        captured step; a pass that raises leaves them off."""
        if self.deltanet is None:
            yield
            return
        self.deltanet.begin(caches)
        yield
        self.deltanet.finish(caches, tokens)

    def _decode_pass(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        kv_tables: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V], routed ids [layers, R * k]) of rows of one token each, row r at
        pos[r] of caches[r]; `kv_tables` [R, max_blocks]: the caches' block tables, read by
        the pass instead of the caches' own (a graph captured per row count)."""
        x, ids = self.run_layers(self.embed[tokens], pos, caches, Decode(len(caches)), kv_tables)
        return self.head(x), ids.reshape(ids.shape[0], -1)

    def run_layers(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        caches: Sequence[KVCache],
        step: Pass,
        kv_tables: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This engine's layers on hidden states x [T, H]: (x, routed ids [rows, T, k]).
        A staged pass streams each layer's experts while the previous layer computes."""
        all_ids = []
        if step.staged:
            self.staging.begin(self.rows.start)
        if step.decode:
            self.attention.begin_decode(pos, caches, kv_tables)
        parts = None
        for i in self.layer_ids:
            nxt = i + 1 - self.first_moe  # the next layer's row, staged while this one runs
            if step.staged and self.rows.start < nxt < self.rows.stop:
                self.staging.prefetch(nxt)
            x, parts, ids = self._layer(i, x, parts, pos, caches, step)
            if ids is not None:
                all_ids.append(ids)
        self.prefetch.finish()
        assert parts is not None
        x = add_parts(x, parts)  # the last layer's experts
        return x, torch.stack(all_ids)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] float32 of the hidden rows x [R, H]."""
        h = rms_norm(x, self.norm, self.spec.rms_eps)
        return self.linear(h, self.lm_head).float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm's output [R, H] float32 of the hidden rows x [R, H]."""
        return rms_norm(x, self.norm, self.spec.rms_eps).float()

    @property
    def row_tokens(self) -> int:
        """A sequence's several new tokens ride in a decode pass (captured as a graph per
        padded row count) unless a CPU share of the misses splits the step into pieces
        captured per set of caches: a short prompt would capture anew each time."""
        split = self.config.pcie_frac < 1.0 and not self.experts.reads_file
        if self.deltanet is not None:  # a sequence's state is one row's (`linear_attention`)
            return 1
        return 1 if split and self._graphs else self.config.row_tokens

    @torch.inference_mode()
    def prepare(self, cache: KVCache) -> None:
        """Capture the decode step of every row count for caches like `cache` (its pool and
        capacity) before any request needs it (`DecodeGraph.prepare`), where steps replay
        graphs."""
        if not (self._graphs and self.config.pcie_frac == 1.0 and not self.experts.reads_file):
            return
        t = time.perf_counter()
        if self.deltanet is not None:  # a state is one row's: the others a capture's padding
            if cache.length:  # (the state the replays advance is an empty cache's, dropped)
                return
            with self._recurrent([cache], [0]):
                n = self.graph.prepare(cache, one_row=True)
            cache.recurrent = None
        else:
            n = self.graph.prepare(cache)
        log.info("decode graphs: every row count captured (%s rows; %d new in %.1f s)",
                 ", ".join(map(str, SIZES)), n, time.perf_counter() - t)  # fmt: skip

    @property
    def _graphs(self) -> bool:
        """Whether decode steps are captured (a recurrent model's too: its states are each
        cache's own tensors, read through the step's address table)."""
        return self.config.graphs and self.device.type == "cuda"

    @property
    def replays_decode(self) -> bool:
        """Whether a decode pass replays a captured graph (not launched op by op)."""
        return self._graphs and self.config.pcie_frac == 1.0 and not self.experts.reads_file

    def decode(
        self, tokens: list[int] | torch.Tensor, pos: list[int], caches: Sequence[KVCache]
    ) -> torch.Tensor:
        """Logits [R, V] of rows of one token each (see `batch.Layers`)."""
        self.experts.apply()
        # a graph replays without the host, which must read the file tier's routed experts
        graph = self.config.pcie_frac == 1.0 and not self.experts.reads_file
        # a CPU share of the misses: the step in pieces, the host's turn between them
        split = self.config.pcie_frac < 1.0 and not self.experts.reads_file
        with self._recurrent(caches, [1] * len(caches)):
            if split and Decode(len(caches)).fused:
                ids_of = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
                logits, ids = self.split(ids_of, pos, caches)
            elif self._graphs and graph:
                logits, ids = self.graph.replay(tokens, pos, caches)
            else:
                logits, ids = self._decode_pass(*decode_inputs(tokens, pos, self.device), caches)
        self.experts.step(ids)
        return logits

    @torch.inference_mode()
    def step(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """One step of a batch: each sequence's `Output` (logits [1, V], or what it asks)."""
        return run_batch(self, seqs)

    @torch.inference_mode()
    def step_ahead(self, caches: list[KVCache], tokens: torch.Tensor) -> torch.Tensor:
        """A decode step of each cache's next token given on the device (`batch.run_ahead`)."""
        return run_ahead(self, caches, tokens)

    def __call__(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """The ReferenceForward interface: logits [1, V] of the last token ([T, V] of all)."""
        return self.step([Seq.logits(cache, tokens, all_logits)])[0]
