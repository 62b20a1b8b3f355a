"""TLS clusters (issue 12; docs/security.md): ``attach(address, security=distributed.Security(...))``, a clear
error without it, and one warning per process that the collectives between workers are not encrypted, which a
Dask config key silences. The certificate is made with the ``openssl`` command (skipped where it is missing)."""

from __future__ import annotations

import shutil
import subprocess
import warnings

import dask
import pytest
import torch
from distributed import LocalCluster, Security

import dask_monarch as dm
from dask_monarch.controller import security as sec_module

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A TLS ``LocalCluster`` of two workers and its ``Security`` (a self-signed certificate for every role)."""
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-subj", "/CN=dask-internal", "-days", "2"],
        check=True, capture_output=True,
    )
    files = {f"tls_{role}_{kind}": str(path) for role in ("client", "scheduler", "worker")
             for kind, path in (("cert", cert), ("key", key))}
    security = Security(tls_ca_file=str(cert), require_encryption=True, **files)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol="tls://", security=security,
                      dashboard_address=":0", silence_logs=40) as cluster:
        yield cluster.scheduler_address, security


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(sec_module, "_warned", False)


def test_attach_by_tls_address_with_security_runs_a_reduce_and_warns_once(tls, fresh_warning):
    address, security = tls
    assert address.startswith("tls://")
    with pytest.warns(sec_module.UnencryptedCommsWarning, match="unencrypted") as record:
        with dm.attach(address, dims={"dp": 2}, security=security, comm_timeout=60) as mesh:
            assert dm.inspect(dm.remote(torch.add)(mesh.rank("dp"), 1).reduce("dp", "sum")).item() == 3
    assert len(record) == 1
    assert "monarch.warn-unencrypted-comms" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sec_module.UnencryptedCommsWarning)  # a second session: no warning
        with dm.attach(address, dims={"dp": 2}, security=security, comm_timeout=60) as mesh:
            assert dm.inspect(mesh.rank("dp")).item() == 0


def test_the_config_key_silences_the_warning(tls, fresh_warning):
    address, security = tls
    with dask.config.set({"monarch.warn-unencrypted-comms": False}), warnings.catch_warnings():
        warnings.simplefilter("error", sec_module.UnencryptedCommsWarning)
        with dm.attach(address, dims={"dp": 2}, security=security, comm_timeout=60) as mesh:
            assert dm.inspect(mesh.rank("dp")).item() == 0


def test_tls_address_without_security_says_to_pass_it(tls):
    address, _ = tls
    with pytest.raises(TypeError, match=r"cannot connect to tls://.* without TLS settings.*security=distributed"):
        dm.attach(address, dims={"dp": 2}, timeout=10)


def test_bad_security_arguments_are_named(tls, client1):
    address, _ = tls
    with pytest.raises(TypeError, match="security must be a distributed.Security"):
        dm.attach(address, security={"tls_ca_file": "x"})
    with pytest.raises(ValueError, match="a Client brings its own security"):
        dm.attach(client1, security=Security())


def test_no_warning_on_a_plain_tcp_cluster(client1, fresh_warning):
    with warnings.catch_warnings():
        warnings.simplefilter("error", sec_module.UnencryptedCommsWarning)
        with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as mesh:
            assert dm.inspect(mesh.rank("workers")).item() == 0


def test_the_answer_sockets_use_tls_on_a_tls_cluster(tls):
    """The answer sockets (``controller/sockets.py``) of a TLS cluster are TLS sockets, with the cluster's
    certificates, and answer the fetches, a tensor whose memory travels out of band included."""
    import ssl

    address, security = tls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sec_module.UnencryptedCommsWarning)
        with dm.attach(address, dims={"dp": 2}, security=security, comm_timeout=60) as mesh:
            channels = mesh._session.channels
            # each rank's own sockets, or its host's relay (``controller/tree.py``: both ranks share 127.0.0.1)
            links = [channels.links[r] or channels.relays[r] for r in range(2)]
            assert all(link is not None for link in links), channels.socket_reasons
            for link in links:
                assert isinstance(link.down, ssl.SSLSocket) and isinstance(link.up, ssl.SSLSocket)
                assert link.down.version() is not None  # the handshake was made
            if channels.relays[0] is not None:  # the relay's own sockets to each rank use TLS as well
                leader = mesh.workers[channels.relays[0].rank]
                tls_links = mesh.client.run(_relay_links_use_tls, mesh.session_id, workers=[leader])[leader]
                assert tls_links == [True, True], tls_links
            with mesh.activate():
                t = torch.arange(3.0) + mesh.rank("dp")
            assert dm.inspect(t, dp=1).tolist() == [1.0, 2.0, 3.0]
            assert dm.fetch_shard(t, dp=0).result(timeout=60).tolist() == [0.0, 1.0, 2.0]
            with mesh.activate():  # 8 MiB: out of band (protocol/tensor_bytes.py), in 64 MiB slices over TLS
                big = torch.arange(2**21, dtype=torch.int32) * (mesh.rank("dp") + 1)
            assert torch.equal(dm.inspect(big, dp=1), torch.arange(2**21, dtype=torch.int32) * 2)
            assert all(channels.socket_chunks[r] > 0 or channels.host_chunks[link.rank] > 0
                       for r, link in enumerate(links))
            assert channels.comm_chunks == [0, 0]


def _relay_links_use_tls(session_id: str, dask_worker=None) -> list:
    """Whether each of the host relay's sockets to its ranks is a TLS socket that made its handshake (``Client.run``
    on the leader)."""
    import ssl

    relay = dask_worker.plugins["dask-monarch"].relays[session_id]
    return [isinstance(link.down, ssl.SSLSocket) and link.down.version() is not None
            for _, link in sorted(relay.links.items())]


def _docs_cluster_commands(scheduler_port: int, dashboard_port: int) -> list[list[str]]:
    """The ``dask scheduler`` and ``dask worker`` command lines of docs/clusters.md's first bash block, with its
    fixed ports replaced by free ones."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "clusters.md").read_text()
    block = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)[0]
    block = block.replace("\\\n", " ").replace("8786", str(scheduler_port)).replace("8787", str(dashboard_port))
    commands = []
    for line in block.splitlines():
        line = line.split(">")[0].strip()
        if line.startswith(("dask scheduler", "dask worker")):
            commands.append(shlex.split(line))
    return commands


def _listen_count(procs) -> int:
    """Listening inet sockets of the processes and their children."""
    import psutil

    count = 0
    for p in procs:
        try:
            for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                count += sum(c.status == psutil.CONN_LISTEN for c in q.net_connections("inet"))
        except psutil.NoSuchProcess:
            pass
    return count


def test_the_documented_cluster_commands_listen_on_127_0_0_1_only(tmp_path):
    """docs/clusters.md says every process its commands start listens on 127.0.0.1 only (issue 26 item 7:
    ``dask worker --host 127.0.0.1`` alone serves its HTTP port on 0.0.0.0). Run those commands and ask the OS
    which addresses the scheduler, the nannies and the workers listen on."""
    import os
    import subprocess
    import sys
    import time

    import psutil
    from conftest import _free_port, stop_processes, wait_until

    commands = _docs_cluster_commands(_free_port(), _free_port())
    assert [c[:2] for c in commands] == [["dask", "scheduler"], ["dask", "worker"], ["dask", "worker"]], commands
    script = os.path.join(os.path.dirname(sys.executable), "dask")
    dask_cli = [script] if os.path.exists(script) else [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen([*dask_cli, *c[1:]], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for c in commands[:1]]
    try:
        time.sleep(1)
        procs += [subprocess.Popen([*dask_cli, *c[1:]], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL) for c in commands[1:]]

        def listening() -> dict[int, set[str]]:
            found = {}
            for p in procs:
                for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                    try:
                        found[q.pid] = {c.laddr.ip for c in q.net_connections("inet")
                                        if c.status == psutil.CONN_LISTEN}
                    except psutil.NoSuchProcess:
                        pass
            return found

        # the scheduler (comm, HTTP), two nannies (comm) and two workers (comm, HTTP): seven listening sockets
        assert wait_until(lambda: _listen_count(procs) >= 7, 60), listening()
        found = listening()
        assert all(ips <= {"127.0.0.1"} for ips in found.values()), found
    finally:
        stop_processes(procs)
