"""Engine processes for the P/D tests: tiny model configs and a JSON-lines client of engine_proc.py."""
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 128  # vLLM's CPU block size

# A tiny GQA Llama (4 query heads, 2 KV heads, head_dim 64) and an OPT-shaped model (MHA, learned
# positions, ReLU), small enough that an engine starts in seconds on 2 cores.
MODELS = {
    "llama-gqa": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                  "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
                  "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "opt": {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 256, "ffn_dim": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1024, "word_embed_proj_dim": 256,
            "max_position_embeddings": 4096, "do_layer_norm_before": True, "activation_function": "relu",
            "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "bfloat16"},
}


# Models whose dummy weights the engine replaces (engine_proc._reinit): the std of the new ones.
INIT_STD = {"opt": 0.1}


def write_model(root: str, name: str) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(MODELS[name], f)
    return d


def prompts(lengths, vocab=1024, seed=0):
    """Token-id prompts of the given lengths (deterministic, ids in [3, vocab))."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


class Engine:
    """One engine_proc.py process; `call` sends a command and waits for its answer (bounded).

    ``core``: the CPU its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's
    "auto" binds every engine to the same cores; a prefill on core 0 and a decode on core 1
    do not compete for one.
    """

    def __init__(self, model: str, role: str, connector: str = "dcp_jax", extra: dict | None = None,
                 env: dict | None = None, log: str | None = None, start_timeout: float = 400.0,
                 core: int | None = None):
        e = dict(os.environ)
        if core is not None:
            e["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
        std = INIT_STD.get(os.path.basename(os.path.normpath(model)))
        if std is not None:
            e["DCP_TEST_INIT_STD"] = str(std)
        e.update(env or {})
        self.log = open(log or os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_proc.py"), model, role,
                                      connector, json.dumps(extra or {})], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=e, text=True, bufsize=1)
        self.start_timeout, self.ready = start_timeout, None
        # A reader thread, not select() on the pipe: vLLM logs to stdout, and lines already in
        # the text wrapper's buffer would never wake a select().
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> dict:
        if self.ready is None:
            self.ready = self._answer(self.start_timeout)
        return self.ready

    def _answer(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine gave no answer within {timeout:g} s (log: {self.log.name})") from None
        if line is None:
            raise RuntimeError(f"engine exited with {self.proc.wait()} (log: {self.log.name})")
        return json.loads(line[2:])

    def call(self, timeout: float = 120.0, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def generate(self, prompts, max_tokens, params=None, timeout=120.0) -> dict:
        return self.call(timeout, op="generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
