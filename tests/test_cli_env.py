"""Operating the command line (issue 14): every flag also STREAMSERVER_<OPTION>, --version,
JSON logs with the tokens redacted, TURN servers with credentials."""

from __future__ import annotations

import json
import logging

import pytest

from streamserver import __version__, cli
from streamserver.cli_env import JsonLines, Redacting, defaults_from_env


def parse(environ: dict[str, str], argv: list[str]):  # noqa: ANN201 - a Namespace
    parser = cli.build_parser()
    defaults_from_env(parser, environ, argv)
    return parser.parse_args(argv)


def test_every_flag_is_also_an_environment_variable():
    args = parse({"STREAMSERVER_REDIS_URL": "redis://central:6379/0", "STREAMSERVER_MAX_QUEUED": "10 5 2",
                  "STREAMSERVER_ICE_SERVER": "stun:a:3478 turn:b:3478", "STREAMSERVER_PORT": "9000",
                  "STREAMSERVER_VAD_HANGOVER_MS": "300"}, ["gateway"])
    assert (args.redis_url, args.max_queued, args.port, args.vad_hangover_ms) == ("redis://central:6379/0", [10, 5, 2], 9000, 300)
    assert args.ice_server == ["stun:a:3478", "turn:b:3478"]
    assert parse({"STREAMSERVER_PORT": "9000"}, ["gateway", "--redis-url", "redis://x", "--port", "7000"]).port == 7000  # a flag wins


def test_a_variable_for_one_command_leaves_the_others_alone():
    """STREAMSERVER_BACKEND=auto is a worker's choice (`engine build --backend` takes tensorrt
    only, `transcribe --precision` no fp16): only the command being run reads its variables."""
    environ = {"STREAMSERVER_BACKEND": "auto", "STREAMSERVER_PRECISION": "fp16", "STREAMSERVER_REDIS_URL": "redis://x"}
    assert parse(environ, ["worker"]).backend == "auto"
    assert parse(environ, ["intent", "hello"]).texts == ["hello"]
    assert parse(environ, ["--log-level", "debug", "worker"]).log_level == "debug"


def test_a_bad_environment_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse({"STREAMSERVER_VAD_HANGOVER_MS": "5"}, ["gateway", "--redis-url", "redis://x"])
    assert exit_.value.code == 2 and "STREAMSERVER_VAD_HANGOVER_MS" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "99999"], ["serve", "--port", "0"], ["serve", "--max-students", "0"],
    ["serve", "--header-timeout", "-1"], ["serve", "--idle-seat", "-5"], ["serve", "--max-queue-wait", "nan"],
    ["serve", "--link-ttl", "0"], ["serve", "--max-audio-rate", "0.5"], ["serve", "--max-queued", "10", "0", "2"],
    ["serve", "--offers-per-minute", "-1"], ["serve", "--threads", "0"], ["serve", "--metrics-port", "70000"],
    ["worker", "--redis-url", "redis://x", "--max-batch", "0"], ["engine", "build", "--max-batch", "-1"],
    ["gateway", "--redis-url", "redis://x", "--fallback-threads", "0"],
])
def test_numbers_a_server_cannot_use_are_usage_errors(argv, capsys):
    """A port past 65535 was a traceback at bind; no students, a negative wait or a batch of none
    started a server that could serve nobody."""
    with pytest.raises(SystemExit) as exit_:
        parse({}, argv)
    assert exit_.value.code == 2 and "is outside" in capsys.readouterr().err


def test_the_edges_of_those_numbers_are_taken():
    args = parse({}, ["serve", "--port", "65535", "--idle-seat", "0", "--offers-per-minute", "0", "--max-audio-rate", "1"])
    assert (args.port, args.idle_seat, args.offers_per_minute, args.max_audio_rate) == (65535, 0, 0, 1)
    assert parse({"STREAMSERVER_MAX_STUDENTS": "10000"}, ["serve"]).max_students == 10000


def test_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"streamserver {__version__}"


def test_json_logs_have_time_and_level_and_no_token():
    record = logging.LogRecord("streamserver.x", logging.WARNING, __file__, 1, "joined via %s", ("/ws/ingest?token=abc.def&name=Ann",), None)
    Redacting().filter(record)
    line = json.loads(JsonLines().format(record))
    assert line["level"] == "warning" and line["ts"].endswith("Z") and "abc.def" not in line["message"]
    assert "token=<redacted>&name=Ann" in line["message"]


def test_turn_servers_carry_their_credentials(tmp_path):
    listed = tmp_path / "ice.json"
    listed.write_text(json.dumps([{"urls": "turns:relay.school:5349", "username": "u2", "credential": "c2"}]))
    args = parse({}, ["serve", "--ice-server", "stun:s:3478", "--ice-server", "turn:t:3478?transport=udp",
                      "--ice-username", "u", "--ice-credential", "c", "--ice-servers-file", str(listed)])
    assert cli._ice_servers(args) == [{"urls": ["stun:s:3478"]},
                                      {"urls": ["turn:t:3478?transport=udp"], "username": "u", "credential": "c"},
                                      {"urls": ["turns:relay.school:5349"], "username": "u2", "credential": "c2"}]


def test_a_redacted_message_keeps_its_percent_signs():
    record = logging.LogRecord("aiohttp.access", logging.INFO, __file__, 1, '"GET %s" %d', ("/ws/ingest?token=a.b&name=Ann%20B", 101), None)
    Redacting().filter(record)
    assert record.getMessage() == '"GET /ws/ingest?token=<redacted>&name=Ann%20B" 101'


def test_a_switch_variable_names_its_value():
    """STREAMSERVER_KEEP_AUDIO is keep_audio, which --no-keep-audio turns off: 0 turns it off too."""
    loadsim = ["loadsim", "--url", "http://x", "--students", "1", "--duration", "1", "--report", "r"]
    assert parse({"STREAMSERVER_KEEP_AUDIO": "0"}, loadsim).keep_audio is False
    assert parse({"STREAMSERVER_KEEP_AUDIO": "1"}, loadsim).keep_audio is True
    assert parse({}, loadsim).keep_audio is True
    assert parse({"STREAMSERVER_JSON": "yes"}, ["models"]).json is True
