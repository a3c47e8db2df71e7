"""Which engine addresses get the no-authentication warning."""

from engine_core.addresses import is_unprotected_tcp


def test_only_non_loopback_tcp_is_unprotected() -> None:
    assert is_unprotected_tcp("tcp://0.0.0.0:5555")
    assert is_unprotected_tcp("tcp://10.1.2.3:5555")
    assert not is_unprotected_tcp("tcp://127.0.0.1:5555")
    assert not is_unprotected_tcp("tcp://localhost:5555")
    assert not is_unprotected_tcp("tcp://[::1]:5555")
    assert not is_unprotected_tcp("ipc:///run/user/1000/pagoda-x/engine")
