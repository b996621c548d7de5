"""ClusterConfig: what `radixkv serve --replicas` deploys is one checked record, built from the
same flags as one engine's; a bad value is a usage error before Ray starts."""

from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.config import ClusterConfig
from engine import EngineConfig


def test_the_replicas_get_the_engine_config_of_the_flags() -> None:
    config = ClusterConfig(replicas=3, engine=EngineConfig.make(page_size=8, threads=2))
    assert config.threads == 2 and config.engine.page_size == 8
    assert ClusterConfig().threads == 1


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--replicas", "0"], "replicas: must be >= 1"),
        (["--replicas", "2", "--page-size", "0"], "page_size: must be an int >= 1"),
        (["--replicas", "2", "--max-queued", "0"], "max_queued: must be an int >= 1"),
        (["--replicas", "2", "--balance-threshold", "-1"], "balance_threshold: must be >= 0"),
        (["--replicas", "2", "--port", "-1"], "--port: must be >= 0"),
    ],
)
def test_bad_replica_settings_exit_2_before_ray_starts(argv, match, capsys) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert f"radixkv: error: {match}" in err and "Traceback" not in err


def test_the_start_up_check_names_a_socket_listening_beyond_loopback() -> None:
    """What ``serve --replicas`` checks once the application is up (and refuses to serve
    on): a listener on every interface is named, loopback ones (IPv4, IPv6) are not."""
    import socket

    pytest.importorskip("psutil")
    from cluster.cli import _exposed_listeners

    sockets = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"),
                         (socket.AF_INET, "0.0.0.0")):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind((host, 0))
        s.listen()
        sockets.append(s)
    try:
        exposed = _exposed_listeners()
        port = sockets[2].getsockname()[1]
        assert any(entry.endswith(f" on 0.0.0.0:{port}") for entry in exposed), exposed
        for s in sockets[:2]:
            assert not any(f":{s.getsockname()[1]}" in entry for entry in exposed), exposed
    finally:
        for s in sockets:
            s.close()
