"""The transformer training step that benches/gpu/step_time.py times (its docstring,
"Workload", says what the step is), for every script that runs it: benches/gpu/step_time.py,
benches/gpu/step_stacks.py, torch_blocks.py's step case and benches/python/real_torch_step.py.

Imports torch only when a TorchWorkload is built, so the drivers load this without it.
"""
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snaputil import memsnap_dump  # noqa: E402

RECORDER_MAX_ENTRIES = 100000  # memsnap's default MEMSNAP_MAX_ENTRIES too
PASS_SYMBOL = "memsnap_debug_pass_through_every_thread"


def add_workload_args(p):
    """The model's and the batch's sizes (TorchWorkload's arguments), for every script that
    runs this step."""
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)


class TorchWorkload:
    """The real training step (step_time.py's docstring, "Workload")."""

    def __init__(self, a):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.a = torch, F, a
        torch.manual_seed(0)
        nn = torch.nn
        layer = nn.TransformerEncoderLayer(a.d_model, a.heads, dim_feedforward=4 * a.d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(a.vocab, a.d_model)
                self.pos = nn.Parameter(torch.randn(a.seq, a.d_model) * 0.02)
                self.encoder = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(a.d_model)
                self.head = nn.Linear(a.d_model, a.vocab)

            def forward(self, x, mask):
                h = self.encoder(self.embed(x) + self.pos, mask=mask, is_causal=True)
                return self.head(self.norm(h))

        self.model = LM().cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.mask = nn.Transformer.generate_square_subsequent_mask(a.seq, device="cuda")
        self.batches = []
        for _ in range(4):
            tokens = torch.randint(a.vocab, (a.batch, a.seq + 1), device="cuda")
            self.batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()))
        self.bf16 = a.dtype == "bf16"
        self.i = 0
        torch.cuda.synchronize()

    def info(self):
        torch = self.torch
        return {"allocator_backend": torch.cuda.get_allocator_backend(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
                "python": platform.python_version(),
                "parameters": sum(p.numel() for p in self.model.parameters())}

    def step(self):
        torch = self.torch
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(x, self.mask)
            loss = self.F.cross_entropy(logits.view(-1, self.a.vocab), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def allocations(self):
        """Blocks the caching allocator handed out so far (None where it does not count them)."""
        try:
            n = self.torch.cuda.memory_stats().get("allocation.all.allocated")
        except RuntimeError:
            return None
        return int(n) if n else None

    def dump(self, tag):
        """memsnap_dump_path of the preloaded library: the snapshot's path, or None."""
        return memsnap_dump(tag) if os.environ.get("LD_PRELOAD") else None

    def pass_through(self, on):
        """memsnap's calls pass through unrecorded on every thread (on) or record again."""
        import ctypes

        getattr(ctypes.CDLL(None), PASS_SYMBOL)(1 if on else 0)

    def recorder(self, mode, clear=False):
        """PyTorch's recorder off (mode None) or on with stacks=mode."""
        history = self.torch.cuda.memory._record_memory_history
        if mode is None:
            history(enabled=None)
            return
        kw = {"enabled": "all", "context": "all", "stacks": mode, "max_entries": RECORDER_MAX_ENTRIES}
        if clear:
            kw["clear_history"] = True
        history(**kw)

    def recorder_check(self, mode):
        """One step with the recorder on and its history cleared: what its snapshot holds."""
        self.recorder(mode, clear=True)
        self.step()
        t0 = time.perf_counter()
        snap = self.torch.cuda.memory._snapshot()
        seconds = time.perf_counter() - t0
        self.recorder(None)
        entries = [e for trace in snap.get("device_traces", []) for e in trace]
        allocs = [e for e in entries if e.get("action") == "alloc"]
        return {"entries_per_step": len(entries), "allocs": len(allocs),
                "allocs_without_frames": sum(1 for e in allocs if not e.get("frames")),
                "snapshot_s": round(seconds, 3)}
