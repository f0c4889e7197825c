"""ServerConfig validation: each bad value is named with what is allowed."""

from __future__ import annotations

import pytest

from encore.server.config import ServerConfig


@pytest.mark.parametrize(("options", "message"), [
    (dict(host=""), "host must be a non-empty address"),
    (dict(port=-1), "port must be an integer in [0, 65535]"),
    (dict(metrics_port=65536), "metrics_port must be an integer in [0, 65535]"),
    (dict(listeners=0), "listeners must be an integer in [1, 256], got 0"),
    (dict(listeners=257), "listeners must be an integer in [1, 256], got 257"),
    (dict(tls_key="key.pem"), "TLS needs both tls_cert and tls_key"),
    (dict(tls_cert="missing.pem", tls_key="missing.pem"), "tls_cert 'missing.pem' is not a file"),
    (dict(api_key="  "), "api_key must be a non-empty string"),
    (dict(max_queued_requests=-1), "max_queued_requests must be an integer >= 0"),
    (dict(max_message_bytes=100), "max_message_bytes must be an integer >= 1024"),
    (dict(shutdown_grace_s=float("nan")), "shutdown_grace_s must be >= 0"),
])
def test_bad_values_are_refused_with_the_reason(options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ServerConfig(**options)


def test_public_items_never_show_the_api_key(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    items = ServerConfig(api_key="secret", tls_cert=str(cert), tls_key=str(cert), metrics_port=9000).public_items()
    assert items["api_key"] == "set" and "secret" not in str(items)
    assert items["tls"] == "true" and items["metrics_port"] == "9000"
    assert ServerConfig().public_items()["api_key"] == "unset"
