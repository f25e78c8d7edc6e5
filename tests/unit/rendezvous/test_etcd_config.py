"""EtcdConfig parsing and validation: tables, no etcd needed."""

import pytest

from elastic.rendezvous.errors import ConfigError
from elastic.rendezvous.etcd import Etcd, EtcdConfig, _RetryStop, _TransientError


@pytest.mark.parametrize(
    "spec, endpoints",
    [
        ("127.0.0.1:2379", (("127.0.0.1", 2379),)),
        ("etcd-0.etcd:2379,etcd-1.etcd:2379", (("etcd-0.etcd", 2379), ("etcd-1.etcd", 2379))),
        ("http://10.0.0.2:2379", (("10.0.0.2", 2379),)),
        ("https://etcd.example.com:443/", (("etcd.example.com", 443),)),
        (" a:1 , b:65535 ", (("a", 1), ("b", 65535))),
        ("[::1]:2379", (("::1", 2379),)),
    ],
)
def test_from_string_accepts(spec, endpoints):
    assert EtcdConfig.from_string(spec).endpoints == endpoints


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nohost:", "invalid etcd endpoint 'nohost:': expected HOST:PORT"),
        (":2379", "invalid etcd endpoint ':2379': expected HOST:PORT"),
        ("a:b", "invalid etcd endpoint 'a:b': expected HOST:PORT"),
        ("", "invalid etcd endpoint '': expected HOST:PORT"),
        ("localhost", "invalid etcd endpoint 'localhost': expected HOST:PORT"),
        ("a:1,,b:2", "invalid etcd endpoint '': expected HOST:PORT"),
        ("a:0", "invalid etcd endpoint 'a:0': port must be in 1..65535"),
        ("a:65536", "invalid etcd endpoint 'a:65536': port must be in 1..65535"),
        ("http://a b:1", "invalid etcd endpoint 'http://a b:1': expected HOST:PORT"),
    ],
)
def test_from_string_rejects_with_one_line_message(spec, message):
    with pytest.raises(ConfigError) as info:
        EtcdConfig.from_string(spec)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(call_timeout=0), "invalid etcd call_timeout 0"),
        (dict(call_timeout=-1.5), "invalid etcd call_timeout -1.5"),
        (dict(retry_deadline=0), "invalid etcd retry_deadline 0"),
        (dict(retry_deadline=float("inf")), "invalid etcd retry_deadline inf"),
        (dict(cert_cert="/x.pem"), "certificate and key must be given together"),
        (dict(cert_key="/x.key"), "certificate and key must be given together"),
        (dict(user="root"), "user and password must be given together"),
        (dict(password="secret"), "user and password must be given together"),
        (dict(ca_cert="/nonexistent/ca.pem"), "etcd ca_cert file not found: /nonexistent/ca.pem"),
    ],
)
def test_validation_names_the_value(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        EtcdConfig(endpoints=(("127.0.0.1", 2379),), **kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_empty_endpoints_and_bad_ports_are_rejected():
    with pytest.raises(ConfigError, match="no etcd endpoint"):
        EtcdConfig(endpoints=())
    with pytest.raises(ConfigError, match="port must be in 1..65535"):
        EtcdConfig(endpoints=(("h", 70000),))


def test_tls_files_must_exist_and_describe_lists_endpoints(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    config = EtcdConfig.from_string("127.0.0.1:2379,10.0.0.2:2379", ca_cert=str(ca))
    assert config.secure
    assert config.describe() == "127.0.0.1:2379,10.0.0.2:2379"
    with pytest.raises(ConfigError, match="cert_key file not found"):
        EtcdConfig.from_string("a:1", ca_cert=str(ca), cert_cert=str(ca), cert_key=str(tmp_path / "missing.key"))


def test_retry_stop_counts_injected_sleeps():
    """With a no-op sleep the policy still ends at the deadline (sleeps count as time spent)."""
    client = Etcd(EtcdConfig.from_string("127.0.0.1:1", retry_deadline=2.0), sleep=lambda s: None)
    attempts = []

    def rpc(channel, timeout, metadata):
        attempts.append(timeout)
        raise _TransientError("UNAVAILABLE: test")

    slept = []
    client._sleep = slept.append
    with pytest.raises(Exception) as info:
        client._call("probe", rpc)
    assert "cannot reach etcd at 127.0.0.1:1 within 2s: UNAVAILABLE: test" == str(info.value)
    assert sum(slept) <= 2.0 and len(attempts) == len(slept) + 1 and len(attempts) > 3
    assert max(slept) <= 1.1  # capped backoff
    client.close()


def test_retry_stop_stops_before_crossing_the_deadline():
    stop = _RetryStop(1.0)

    class State:
        seconds_since_start, idle_for, upcoming_sleep = 0.5, 0.7, 0.2

    assert not stop(State())
    State.upcoming_sleep = 0.4
    assert stop(State())


def test_retry_deadline_option_reaches_the_agent_and_its_workers(tmp_path, monkeypatch):
    """--etcd-retry-deadline (or ELASTIC_ETCD_RETRY_DEADLINE) sets the agent's client and
    travels to every worker's; without it both keep EtcdConfig's default."""
    from elastic.agent.config import config_for_worker
    from elastic.cli.launch import etcd_config, parse
    from elastic.contract.worker_config import WorkerConfig

    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--rdzv-endpoint", "127.0.0.1:2379", "--job-id", "j", "--host-addr", "127.0.0.1", "--np", "1"]

    def worker_side(config):
        worker = config_for_worker(config, "m.w0", 1, endpoints="127.0.0.1:2379", member_id="m",
                                   events_file="e", scratch=str(tmp_path), progress_file=None, stacks_file=None,
                                   final_checkpoint_file="f")
        return WorkerConfig.from_env(worker.to_env()).etcd_retry_deadline

    config, args = parse([*base, "--etcd-retry-deadline", "2.5", str(script)])
    assert etcd_config(args).retry_deadline == 2.5 and worker_side(config) == 2.5
    monkeypatch.setenv("ELASTIC_ETCD_RETRY_DEADLINE", "4")
    config, args = parse([*base, str(script)])
    assert etcd_config(args).retry_deadline == 4.0 and worker_side(config) == 4.0
    monkeypatch.delenv("ELASTIC_ETCD_RETRY_DEADLINE")
    config, args = parse([*base, str(script)])
    assert etcd_config(args).retry_deadline == EtcdConfig.__dataclass_fields__["retry_deadline"].default
    assert worker_side(config) is None
    with pytest.raises(ConfigError):
        parse([*base, "--etcd-retry-deadline", "0", str(script)])


def test_from_string_gives_an_option_passed_as_none_its_default():
    """Callers pass options the user may not have set (None) straight through."""
    config = EtcdConfig.from_string("127.0.0.1:2379", retry_deadline=None, call_timeout=None, ca_cert=None)
    assert config == EtcdConfig.from_string("127.0.0.1:2379")
    assert config.retry_deadline == EtcdConfig.__dataclass_fields__["retry_deadline"].default
    assert EtcdConfig.from_string("127.0.0.1:2379", retry_deadline=2.5).retry_deadline == 2.5
