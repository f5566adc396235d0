"""Registered weights are downloaded once into the cache and reused offline (backbones/download.py).

Every download here comes from an HTTP server on the loopback address, in a thread of the test process,
serving a real weights file: timm's MobileViTv2-0.5 under CVNets' names (as CVNets' model zoo publishes
it) or timm's own names as safetensors (as the Hugging Face hub does). The loaded backbone must give timm's
output. Nothing reaches outside the machine: the offline switch is on wherever no server is meant to answer.
"""
from __future__ import annotations

import hashlib
import http.server
import io
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from backbones.download import WeightsUnavailable, cache_path
from backbones.mobilevitv2 import MobileViTv2
from backbones.pretrained import PRETRAINED, PretrainedWeights
from tests.test_weights import cvnets_state_dict, pooled, timm_model

REPO = Path(__file__).resolve().parents[1]
CVNETS_PATH = "/ml-research/models/cvnets-v2/classification/mobilevitv2/imagenet1k/256x256/mobilevitv2-0.5.pt"


class FileServer(http.server.ThreadingHTTPServer):
    """Serves ``files`` (URL path -> bytes) on 127.0.0.1; counts the GETs of each path; ``cut`` paths are
    sent with their full Content-Length but only half their bytes, then the connection closes; a GET waits
    for ``gate`` (set by default)."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.gets: dict[str, int] = {}
        self.cut: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        server: FileServer = self.server
        server.gets[self.path] = server.gets.get(self.path, 0) + 1
        server.gate.wait(30)
        body = server.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path in server.cut:
            server.cut.discard(self.path)  # the next try gets it whole
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server():
    server = FileServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference():
    return timm_model("mobilevitv2_050")


@pytest.fixture(scope="module")
def cvnets_bytes(reference) -> bytes:
    """CVNets' model-zoo file of MobileViTv2-0.5 (timm's weights under CVNets' names)."""
    buffer = io.BytesIO()
    torch.save(cvnets_state_dict(reference), buffer)
    return buffer.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache and working directory; no offline switch set by the caller's environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUITE_WEIGHTS_DIR", str(tmp_path / "cache"))
    for variable in ("SUITE_OFFLINE", "HF_HUB_OFFLINE", "SUITE_WEIGHTS_MIRROR", "HF_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path / "cache"


def register(monkeypatch, url: str, name: str = "mobilevitv2_050.loopback_test", converter: str = "cvnets",
             sha256: str | None = None) -> PretrainedWeights:
    """A registered entry for this test only (removed after it), like the CVNets MobileViTv2-0.5 entry."""
    like = PRETRAINED.get("mobilevitv2_050.cvnets_in1k")
    entry = PretrainedWeights(name=name, backbone="mobilevitv2", arguments={"width": 0.5}, converter=converter,
                              url=url, file=f"checkpoints/loopback/{name}.pt", preprocessing=like.preprocessing,
                              sha256=sha256)
    monkeypatch.setitem(PRETRAINED._entries, name, entry)
    return entry


def gives_reference_output(backbone, reference) -> None:
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(backbone.eval().forward_pooled(x), pooled(reference, x), rtol=1e-4, atol=1e-5)


def refusal(entry: PretrainedWeights, url: str) -> str:
    """Building the backbone from ``entry`` is refused: the one-line message, which names the entry, the URL
    and the cache path."""
    with pytest.raises(WeightsUnavailable) as err:
        MobileViTv2(width=0.5, pretrained=entry.name)
    message = str(err.value)
    assert "\n" not in message and entry.name in message and url in message, message
    assert str(cache_path(entry, url)) in message, message
    return message


def leftovers(folder: Path) -> list[str]:
    """Files a reader could take for weights (the lock file is not one)."""
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def test_first_run_downloads_into_the_cache_and_later_runs_read_it_without_the_server(server, cache, monkeypatch,
                                                                                      reference, cvnets_bytes):
    server.files["/w/mobilevitv2-0.5.pt"] = cvnets_bytes
    entry = register(monkeypatch, server.address + "/w/mobilevitv2-0.5.pt",
                     sha256=hashlib.sha256(cvnets_bytes).hexdigest())
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert server.gets == {"/w/mobilevitv2-0.5.pt": 1}
    cached = cache / entry.name / "mobilevitv2-0.5.pt"
    assert cache_path(entry) == cached and cached.read_bytes() == cvnets_bytes
    assert leftovers(cache) == ["mobilevitv2-0.5.pt"]

    server.stop()  # no network: the cache serves, with the offline switch on too
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    monkeypatch.setenv("SUITE_OFFLINE", "1")
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)


def test_a_registered_cvnets_entry_comes_through_the_mirror_at_its_own_path(server, cache, monkeypatch, reference,
                                                                            cvnets_bytes):
    """``SUITE_WEIGHTS_MIRROR`` replaces the host of CVNets' address and keeps its path."""
    server.files[CVNETS_PATH] = cvnets_bytes
    monkeypatch.setenv("SUITE_WEIGHTS_MIRROR", server.address + "/")
    entry = PRETRAINED.get("mobilevitv2_050.cvnets_in1k")
    assert entry.url == "https://docs-assets.developer.apple.com" + CVNETS_PATH
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert server.gets == {CVNETS_PATH: 1}
    assert (cache / entry.name / "mobilevitv2-0.5.pt").read_bytes() == cvnets_bytes


def test_a_file_put_at_the_entrys_place_wins_and_nothing_is_fetched(server, cache, monkeypatch, reference,
                                                                     cvnets_bytes):
    entry = register(monkeypatch, server.address + "/w/mobilevitv2-0.5.pt")
    Path(entry.file).parent.mkdir(parents=True)
    Path(entry.file).write_bytes(cvnets_bytes)
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert server.gets == {} and not cache.exists()


def test_a_hash_mismatch_is_refused_and_leaves_nothing_in_the_cache(server, cache, monkeypatch, cvnets_bytes):
    server.files["/w/mobilevitv2-0.5.pt"] = cvnets_bytes
    published = hashlib.sha256(b"the file that was published").hexdigest()
    url = server.address + "/w/mobilevitv2-0.5.pt"
    message = refusal(register(monkeypatch, url, sha256=published), url)
    assert f"its sha256 is {hashlib.sha256(cvnets_bytes).hexdigest()}, not the published {published}" in message
    assert leftovers(cache) == []


def test_an_interrupted_download_leaves_no_partial_file_and_the_next_run_succeeds(server, cache, monkeypatch,
                                                                                  reference, cvnets_bytes):
    server.files["/w/mobilevitv2-0.5.pt"] = cvnets_bytes
    server.cut.add("/w/mobilevitv2-0.5.pt")
    url = server.address + "/w/mobilevitv2-0.5.pt"
    entry = register(monkeypatch, url)  # no published hash: completeness is checked against Content-Length
    message = refusal(entry, url)
    assert f"stopped after {len(cvnets_bytes) // 2} of {len(cvnets_bytes)} bytes" in message
    assert leftovers(cache) == []
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert server.gets == {"/w/mobilevitv2-0.5.pt": 2}


def test_offline_with_an_empty_cache_says_what_to_download_where(server, cache, monkeypatch):
    url = server.address + "/w/mobilevitv2-0.5.pt"
    entry = register(monkeypatch, url)
    monkeypatch.setenv("SUITE_OFFLINE", "1")
    assert "SUITE_OFFLINE=1 forbids downloading" in refusal(entry, url)
    assert server.gets == {}


def test_an_unreachable_address_is_one_line(cache, monkeypatch):
    with socket.socket() as closed:  # a loopback port nobody listens on once this socket closes
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/w/mobilevitv2-0.5.pt"
    message = refusal(register(monkeypatch, url), url)
    assert "no connection" in message and "download the file by hand to that path" in message
    assert leftovers(cache) == []


def test_timm_tags_come_from_the_hub_as_safetensors_and_honour_hf_hub_offline(server, cache, monkeypatch, reference):
    """A timm tag names a hub repository; ``HF_ENDPOINT`` points the hub's address at the loopback server, which
    publishes timm's own state dict as ``model.safetensors``; ``HF_HUB_OFFLINE=1`` forbids the download."""
    from safetensors.torch import save

    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    server.files["/timm/mobilevitv2_050.loopback_test/resolve/main/model.safetensors"] = save(state)
    entry = register(monkeypatch, "timm/mobilevitv2_050.loopback_test", converter="timm")
    monkeypatch.setenv("HF_ENDPOINT", server.address)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url = f"{server.address}/timm/mobilevitv2_050.loopback_test/resolve/main/model.safetensors"
    assert "HF_HUB_OFFLINE=1 forbids downloading" in refusal(entry, url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert (cache / entry.name / "model.safetensors").is_file()


def test_a_hub_repo_without_safetensors_gives_timms_next_file_and_one_with_neither_is_one_line(
        server, cache, monkeypatch, reference):
    """timm's loader takes ``pytorch_model.bin`` where a repo has no ``model.safetensors``; so does the suite."""
    buffer = io.BytesIO()
    torch.save(reference.state_dict(), buffer)
    repo = "/timm/mobilevitv2_050.loopback_test/resolve/main"
    server.files[f"{repo}/pytorch_model.bin"] = buffer.getvalue()
    entry = register(monkeypatch, "timm/mobilevitv2_050.loopback_test", converter="timm")
    monkeypatch.setenv("HF_ENDPOINT", server.address)
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert server.gets == {f"{repo}/model.safetensors": 1, f"{repo}/pytorch_model.bin": 1}
    assert leftovers(cache) == ["pytorch_model.bin"]

    other = register(monkeypatch, "timm/mobilevitv2_050.unpublished", name="mobilevitv2_050.unpublished",
                     converter="timm")
    url = f"{server.address}/timm/mobilevitv2_050.unpublished/resolve/main/pytorch_model.bin"
    assert "answers 404 (not found)" in refusal(other, url)


def test_a_timm_tag_that_timm_already_fetched_is_read_from_the_hub_cache(cache, monkeypatch, reference):
    """``timm.create_model(name, pretrained=True)`` left the file in the Hugging Face hub cache (its layout:
    ``models--<org>--<name>/snapshots/<revision>/<file>``, ``refs/main`` naming the revision): it is read from
    there, offline, and not fetched again."""
    import huggingface_hub.constants
    from safetensors.torch import save_file

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache.parent / "hub"))
    repo = cache.parent / "hub" / "models--timm--mobilevitv2_050.loopback_test"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()},
              repo / "snapshots" / "0123abc" / "model.safetensors")
    entry = register(monkeypatch, "timm/mobilevitv2_050.loopback_test", converter="timm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gives_reference_output(MobileViTv2(width=0.5, pretrained=entry.name), reference)
    assert not cache.exists()


def test_the_suites_own_weights_are_never_downloaded_and_name_their_recipe(cache):
    entry = PRETRAINED.get("mobilevitv2_150.suite_in21k_p")
    with pytest.raises(WeightsUnavailable) as err:
        MobileViTv2(width=1.5, pretrained=entry.name)
    message = str(err.value)
    assert "\n" not in message and "made by training" in message
    assert "configs/classify/imagenet21kp_mobilevitv2_150.yaml" in message and str(cache_path(entry)) in message


@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="reads Linux's table of file locks")
def test_two_processes_asking_at_once_download_once(server, tmp_path):
    """Both processes wait on the lock (this test holds it until the kernel shows both waiting); then one
    downloads and the other reads its file."""
    import fcntl

    server.files["/w/blob.pt"] = os.urandom(1 << 16)
    dest = tmp_path / "cache" / "blob.pt"
    dest.parent.mkdir()
    # the module file alone: neither torch nor the suite's packages, so each process starts in a fraction of a second
    module = REPO / "backbones" / "download.py"
    script = (f"import importlib.util as u; s = u.spec_from_file_location('download', {str(module)!r}); "
              f"m = u.module_from_spec(s); s.loader.exec_module(m); "
              f"print(m.download_once({server.address + '/w/blob.pt'!r}, m.Path({str(dest)!r})))")
    with open(dest.parent / ".blob.pt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2)]
        inode = os.fstat(lock.fileno()).st_ino
        for _ in range(600):  # the kernel lists a process blocked on a lock as "-> FLOCK ... <dev>:<inode> ..."
            waiting = [line for line in Path("/proc/locks").read_text().splitlines()
                       if "->" in line and f":{inode} " in line]
            if len(waiting) == 2 or any(p.poll() is not None for p in processes):
                break
            threading.Event().wait(0.05)
        assert len(waiting) == 2, [p.communicate() for p in processes]
    outputs = [p.communicate(timeout=60) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == [str(dest)] * 2
    assert server.gets == {"/w/blob.pt": 1} and dest.read_bytes() == server.files["/w/blob.pt"]
    assert sum("downloading" in err for _, err in outputs) == 1


# -- through the command ---------------------------------------------------------------------------------------
@pytest.mark.slow  # ~25 s here, nearly all of it the CLI's imports
def test_the_cli_refuses_unavailable_weights_in_one_line(run_cli, tmp_path):
    """A new user's first command offline: one line naming the entry, the URL and the cache path, no traceback."""
    entry = PRETRAINED.get("mobilevitv2_050.cvnets_in1k")
    proc = run_cli("classify", "fit", "--model.weights", entry.name, "--trainer.max_steps", "1", check=False,
                   env={"SUITE_OFFLINE": "1", "SUITE_WEIGHTS_DIR": str(tmp_path / "cache")})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert entry.name in line and entry.url in line and str(tmp_path / "cache" / entry.name) in line, line


@pytest.mark.slow
def test_the_cli_fetches_cvnets_weights_through_a_mirror_and_its_checkpoint_needs_no_download(run_cli, tmp_path,
                                                                                              server, cvnets_bytes):
    """``fit --model.weights mobilevitv2_050.cvnets_in1k`` with ``SUITE_WEIGHTS_MIRROR`` on the loopback server
    (serving the file at CVNets' own path) downloads it once; the checkpoint is then tested offline, with an
    empty cache: it rebuilds the model from its own weights."""
    server.files[CVNETS_PATH] = cvnets_bytes
    cache = tmp_path / "cache"
    run_cli("classify", "fit", "--model.weights", "mobilevitv2_050.cvnets_in1k", "--trainer.max_steps", "1",
            "--trainer.logger", "false",
            env={"SUITE_WEIGHTS_MIRROR": server.address, "SUITE_WEIGHTS_DIR": str(cache), "SUITE_OFFLINE": "0"})
    assert server.gets == {CVNETS_PATH: 1}
    assert (cache / "mobilevitv2_050.cvnets_in1k" / "mobilevitv2-0.5.pt").read_bytes() == cvnets_bytes
    checkpoint = next((tmp_path / "runs" / "classify").rglob("last.ckpt"))
    server.stop()
    run_cli("classify", "test", "--ckpt_path", str(checkpoint), "--trainer.limit_test_batches", "1",
            "--trainer.logger", "false", env={"SUITE_OFFLINE": "1", "SUITE_WEIGHTS_DIR": str(tmp_path / "empty")})
