"""The AWS and GCP notice sources against recorded documents served over real HTTP on loopback
(tests/fake_metadata.py): AWS IMDSv2's token flow (TTL header, token on every GET, a new token on
401 and before the old one expires) and ``spot/instance-action`` (404: none; each documented
action: a notice), GCP's ``instance/preempted`` (the ``Metadata-Flavor`` header both ways, the
bounded ``wait_for_change`` long poll with the ETag). A bad or unreachable endpoint is one line
and back-off, never an exception and never a line or request per poll; the agent loads both by
the names the registry and the docs give. A fake clock drives the back-off and the token's TTL.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from fake_metadata import (
    INSTANCE_ACTION_HIBERNATE,
    INSTANCE_ACTION_STOP,
    INSTANCE_ACTION_TERMINATE,
    FakeGCPMetadata,
    FakeIMDS,
)

from manager.agent.aws_imds import ACTION_PATH, InstanceActionClient, parse_instance_action
from manager.agent.gcp_metadata import PreemptedClient, parse_preempted
from manager.agent.metadata_http import MetadataError
from manager.agent.notices import load_notice_source
from manager.providers.agent_start import agent_argv
from manager.providers.base import ProviderContext
from manager.providers.registry import make_provider, provider_entry

UNREACHABLE = "http://127.0.0.1:1"  # nothing listens on port 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def imds():
    server = FakeIMDS()
    yield server
    server.close()


@pytest.fixture
def gcp():
    server = FakeGCPMetadata()
    yield server
    server.close()


def aws_client(imds: FakeIMDS, said: list, clock: Clock | None = None, **kw) -> InstanceActionClient:
    return InstanceActionClient(imds.base("i-0abc"), "vm-1", say=said.append, clock=clock or Clock(), **kw)


# -- AWS IMDSv2 ---------------------------------------------------------------------------------


def test_no_interruption_is_no_notice_with_one_token_for_many_polls(imds):
    said: list[str] = []
    client = aws_client(imds, said)
    assert [client.poll() for _ in range(3)] == [[], [], []]
    assert client.token_requests == 1
    assert imds.requests == {"PUT /latest/api/token": 1, "GET " + ACTION_PATH: 3}
    assert said == []


@pytest.mark.parametrize("doc", [INSTANCE_ACTION_TERMINATE, INSTANCE_ACTION_STOP, INSTANCE_ACTION_HIBERNATE],
                         ids=lambda d: d["action"])
def test_each_documented_action_is_a_notice(imds, doc):
    said: list[str] = []
    client = aws_client(imds, said)
    assert client.poll() == []
    imds.interrupt("i-0abc", doc)
    [notice] = client.poll()
    assert (notice.event_type, notice.not_before) == (f"spot-{doc['action']}", "2017-09-18T08:22:00Z")
    assert notice == parse_instance_action(json.dumps(doc))
    assert client.poll() == [notice]  # kept: an interruption is not called off
    assert not client.approve(notice.event_id)  # EC2 has no such step
    assert said == []


def test_an_expired_token_is_replaced_on_401_and_renewed_before_its_ttl(imds):
    said: list[str] = []
    clock = Clock()
    client = aws_client(imds, said, clock, token_ttl_s=300)
    assert client.poll() == [] and client.token_requests == 1
    imds.expire_tokens()  # IMDS forgets it (a reboot, a TTL shorter than we thought): 401
    imds.interrupt("i-0abc")
    assert [n.event_type for n in client.poll()] == ["spot-terminate"]
    assert client.token_requests == 2 and imds.requests["GET " + ACTION_PATH] == 3  # 200, 401, 200
    assert said == []  # a 401 is the protocol, not a failure
    quiet = InstanceActionClient(imds.base("i-0def"), "vm-2", say=said.append, clock=clock, token_ttl_s=300)
    quiet.poll()
    clock.now += 239  # the token is kept until a minute before its TTL ends...
    quiet.poll()
    assert quiet.token_requests == 1
    clock.now += 2  # ...then renewed before IMDS would refuse it
    quiet.poll()
    assert quiet.token_requests == 2 and said == []


def test_the_fake_refuses_what_imds_refuses(imds):
    """Negative controls for the fake itself: no TTL header, no token → refused."""
    with pytest.raises(urllib.error.HTTPError) as no_ttl:
        urllib.request.urlopen(urllib.request.Request(imds.base("i-0abc") + "/latest/api/token", method="PUT",
                                                      data=b""), timeout=10)
    assert no_ttl.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as no_token:
        urllib.request.urlopen(imds.base("i-0abc") + ACTION_PATH, timeout=10)
    assert no_token.value.code == 401


def test_unreachable_imds_is_one_line_and_back_off():
    said: list[str] = []
    clock = Clock()
    client = InstanceActionClient(UNREACHABLE, "vm-1", say=said.append, clock=clock, timeout_s=2)
    assert client.poll() == []
    assert len(said) == 1 and said[0].startswith(f"notice source AWS IMDS at {UNREACHABLE}: ")
    assert "no notice can be seen until it answers (retrying with back-off)" in said[0]
    tried = client.token_requests
    for _ in range(5):  # within the back-off: no request, no line
        assert client.poll() == []
    assert client.token_requests == tried
    for step in (1, 2, 4, 8):  # then 1, 2, 4, 8 s apart, still one line
        clock.now += step
        assert client.poll() == []
        assert client.token_requests == tried + 1
        tried = client.token_requests
    assert len(said) == 1 and client.endpoint.failures == 5


@pytest.mark.parametrize("broken, why", [(500, "PUT /latest/api/token answered HTTP 500"),
                                        ("<html>maintenance</html>", "spot/instance-action is not")])
def test_a_bad_answer_is_one_line_then_it_recovers(imds, broken, why):
    said: list[str] = []
    clock = Clock()
    client = aws_client(imds, said, clock)
    imds.interrupt("i-0abc")
    imds.broken = broken
    assert client.poll() == [] and client.poll() == []
    assert len(said) == 1 and why in said[0], said
    imds.broken = None
    clock.now += 1
    assert [n.event_type for n in client.poll()] == ["spot-terminate"]
    base = imds.base("i-0abc")
    assert said[1] == f"notice source AWS IMDS at {base}: answers again after 1 failed request(s)"


def test_parse_refuses_what_aws_does_not_document():
    bodies = ("", "[]", '{"action": "reboot", "time": "x"}', '{"time": "x"}', '{"action": "stop", "time": 5}')
    for body in bodies:
        with pytest.raises(MetadataError, match="spot/instance-action is not"):
            parse_instance_action(body)


# -- GCP metadata -------------------------------------------------------------------------------


def test_not_preempted_then_preempted_with_a_bounded_long_poll(gcp):
    said: list[str] = []
    client = PreemptedClient(gcp.url, "vm-1", say=said.append, wait_s=30)
    assert client.poll() == []
    assert gcp.requests == [{}]  # the first question is plain
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(client.poll()))
    waiter.start()
    # The waiting request is a long poll on the ETag of FALSE; it answers when the value changes.
    while len(gcp.requests) < 2 and waiter.is_alive():
        waiter.join(0.05)
    gcp.preempt()
    waiter.join(25)  # the poll waits up to 30 s: answered well before means wait_for_change works
    assert not waiter.is_alive(), "the long poll did not answer when the value changed"
    [notices] = got
    assert [n.event_type for n in notices] == ["Preempt"] and notices[0].not_before.endswith("Z")
    assert gcp.requests[1]["wait_for_change"] == "true" and gcp.requests[1]["timeout_sec"] == "30"
    assert gcp.requests[1]["last_etag"] == FakeGCPMetadata._etag("FALSE")
    assert client.poll() == notices and len(gcp.requests) == 2  # kept, not asked again
    assert not client.approve(notices[0].event_id) and said == []


def test_a_long_poll_without_change_answers_after_its_timeout(gcp):
    client = PreemptedClient(gcp.url, "vm-1", say=pytest.fail, wait_s=1)
    assert client.poll() == [] and client.poll() == []  # the second waited 1 s and got FALSE again
    assert gcp.requests[1]["timeout_sec"] == "1"


def test_the_flavor_header_is_sent_and_required_back(gcp):
    with pytest.raises(urllib.error.HTTPError) as refused:  # the fake, as GCP: no header, 403
        urllib.request.urlopen(gcp.url + FakeGCPMetadata.PATH, timeout=10)
    assert refused.value.code == 403
    said: list[str] = []
    gcp.flavor_header = False  # a server that is not GCP's metadata server
    gcp.preempted = True
    client = PreemptedClient(gcp.url, "vm-1", say=said.append, clock=Clock())
    assert client.poll() == []
    assert said == [
        f"notice source GCP metadata at {gcp.url}: the answer has no 'Metadata-Flavor: Google' header: "
        "not a GCP metadata server; no notice can be seen until it answers (retrying with back-off)"]


@pytest.mark.parametrize("broken, why", [(503, "answered HTTP 503"),
                                         ("maybe", "is not TRUE or FALSE: 'maybe'")])
def test_a_bad_gcp_answer_is_one_line_and_back_off(gcp, broken, why):
    said: list[str] = []
    clock = Clock()
    gcp.broken = broken
    client = PreemptedClient(gcp.url, "vm-1", say=said.append, clock=clock, wait_s=0)
    assert [client.poll() for _ in range(4)] == [[]] * 4
    assert len(gcp.requests) == 1 and len(said) == 1 and why in said[0]
    gcp.broken = None
    gcp.preempt()
    clock.now += 1
    assert [n.event_type for n in client.poll()] == ["Preempt"]
    assert said[-1].endswith("answers again after 1 failed request(s)")


def test_unreachable_gcp_metadata_is_one_line():
    said: list[str] = []
    client = PreemptedClient(UNREACHABLE, "vm-1", say=said.append, clock=Clock())
    assert client.poll() == [] and client.poll() == []
    assert len(said) == 1 and said[0].startswith(f"notice source GCP metadata at {UNREACHABLE}: ")


def test_parse_preempted():
    assert parse_preempted("TRUE\n") and not parse_preempted("FALSE")
    for body in ("true", "", "1"):
        with pytest.raises(MetadataError):
            parse_preempted(body)


# -- how agents find them -----------------------------------------------------------------------


def test_agents_load_them_by_the_names_the_registry_and_docs_give():
    aws = load_notice_source(provider_entry("aws").notice_source, url=None, vm_name="vm-1")
    assert isinstance(aws, InstanceActionClient) and aws.url == "http://169.254.169.254"
    gcp = load_notice_source("manager.agent.gcp_metadata:PreemptedClient", url=None, vm_name="vm-1")
    assert isinstance(gcp, PreemptedClient) and gcp.url == "http://metadata.google.internal"


def test_pretend_vms_take_another_clouds_notice_source(tmp_path):
    """The local provider's ``notice_source``: a provider's name or a ``module:Class``; its agents
    get it on their command line (default: Azure's, the local provider's own)."""
    ctx = ProviderContext(manager_address="127.0.0.1:1", token_file="/t", state_dir=str(tmp_path))
    gcp_source = "manager.agent.gcp_metadata:PreemptedClient"
    for value, source in [(gcp_source, gcp_source), ("aws", provider_entry("aws").notice_source),
                          (None, provider_entry("local").notice_source)]:
        options = {"metadata_url": "http://127.0.0.1:1", **({"notice_source": value} if value else {})}
        argv = agent_argv(make_provider("local", options, ctx).agent_start("j", "j-vm1", 1, tmp_path))
        assert argv[argv.index("--notice-source") + 1] == source
        assert argv[argv.index("--notice-url") + 1] == "http://127.0.0.1:1"
    for bad, needle in [("gcp", "provider_options.notice_source: unknown provider 'gcp'; use one of local, "),
                        ("kubectl:", "unknown provider 'kubectl:'")]:
        with pytest.raises(ValueError) as refused:
            make_provider("local", {"notice_source": bad}, ctx)
        line = str(refused.value)
        assert line.startswith("provider_options.notice_source: ") and needle in line, line
        assert line.endswith("; or name a module:Class") and "\n" not in line
