"""Grammar-constrained decoding in the engine: outputs match their grammar and end where it does,
greedy output equals a reference decoded step by step with llguidance's masks over transformers'
logits, bad grammars are rejected at the door, and n > 1 choices keep their own grammar state."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling.grammar import GrammarCompiler, GrammarSpec, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}
PROMPTS = [[5, 9, 14, 20], [40, 41, 42], [100, 3, 77, 8, 9, 10]]


def schema_spec(schema=SCHEMA) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), draft=None, block_size=4, num_kv_blocks=512)


def generate(llm, spec, prompts=PROMPTS, **settings):
    params = SamplingParams(structured=spec, **{"temperature": 0, "max_tokens": 80, **settings})
    return llm.generate(prompts, params, use_tqdm=False)


def test_json_schema_output_parses_validates_and_ends_with_the_grammar(llm):
    for output in generate(llm, schema_spec()):
        choice = output.outputs[0]
        value = json.loads(choice.text)
        assert set(value) == {"name", "count", "ok"}
        assert len(value["name"]) <= 6 and 0 <= value["count"] <= 99
        assert choice.finish_reason == "stop" and choice.token_ids[-1] == 2  # EOS


@pytest.mark.parametrize(
    "spec, check",
    [
        (GrammarSpec("regex", r"(red|green|blue)-[0-9]{2}"), r"(red|green|blue)-[0-9]{2}"),
        (GrammarSpec("choice", json.dumps(["a+b", "c.d", "(x)"])), r"a\+b|c\.d|\(x\)"),
        (GrammarSpec("lark", 'start: "<" NUM ">"\nNUM: /[0-9]{1,3}/'), r"<[0-9]{1,3}>"),
    ],
)
def test_regex_choice_and_lark_outputs_match(llm, spec, check):
    for output in generate(llm, spec, temperature=1.0, seed=3):
        assert re.fullmatch(check, output.outputs[0].text), output.outputs[0].text


def test_json_object_mode_always_parses(llm):
    outputs = generate(llm, GrammarSpec("json_object"), temperature=1.0, seed=0, max_tokens=300)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert finished, "some object should close within the token limit"
    for choice in finished:
        assert isinstance(json.loads(choice.text), dict)
    for output in outputs:  # the others are an object's beginning
        assert output.outputs[0].text.startswith("{")


def reference_greedy(model_dir, prompt: list[int], spec: GrammarSpec, max_tokens: int):
    """Constrained greedy decoding written out: llguidance's mask over transformers' logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, {2})
    matcher = compiler.compile(spec).matcher()
    tokens: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        allowed = unpack_bitmask(matcher.bitmasks_along([tokens]), len(logits))[0]
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        tokens.append(token)
        if token == 2:
            break
    return tokens


def test_greedy_equals_reference_constrained_decoding(llm, tiny_models):
    spec = schema_spec()
    for prompt, output in zip(PROMPTS, generate(llm, spec)):
        expected = reference_greedy(tiny_models["llama"], prompt, spec, 80)
        assert output.outputs[0].token_ids == expected


def test_choices_keep_their_own_grammar_state(llm):
    spec = GrammarSpec("regex", r"[a-z]{3}![0-9]")
    (output,) = generate(llm, spec, prompts=[PROMPTS[0]], n=4, temperature=1.0, seed=1)
    assert len(output.outputs) == 4
    for choice in output.outputs:
        assert re.fullmatch(r"[a-z]{3}![0-9]", choice.text)


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("json_schema", '{"type": "foo"}'), "Invalid type: foo"),
        (GrammarSpec("json_schema", '{"$ref": "#/missing"}'), "does not exist"),
        (GrammarSpec("regex", "(("), "unclosed group"),
        (GrammarSpec("lark", "start: undefined_rule"), "unknown name"),
    ],
)
def test_bad_grammars_are_rejected_naming_the_problem(llm, spec, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        llm.engine.make_request("bad", [5, 6], SamplingParams(structured=spec))


def test_compiled_grammars_are_cached_per_spec(llm):
    compiler = llm.engine.grammars
    assert compiler.compile(schema_spec()) is compiler.compile(schema_spec())
    assert compiler.compile(schema_spec()) is not compiler.compile(GrammarSpec("json_object"))


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=GrammarSpec("json_object"))


def test_forced_tokens_follow_the_grammar_and_leave_the_matcher_in_place(tiny_models):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])
    compiled = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    matcher = compiled.compile(GrammarSpec("regex", r"ID-(ab|cd)!")).matcher()
    ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in "ID-abc!"}
    paths = [
        [],
        [ids["I"]],
        [ids["I"], ids["D"], ids["-"]],
        [ids["I"], ids["D"], ids["-"], ids["a"]],
    ]
    paths.append([ids["!"]])  # forbidden: forces nothing
    masks, forced = matcher.drafts_along(paths)
    assert forced == [ids["I"], ids["D"], -1, ids["b"], -1]  # after "ID-" the choice is open
    assert torch.equal(masks, matcher.bitmasks_along(paths))
    assert matcher.drafts_along([[]])[1] == [ids["I"]]  # the matcher stayed at the start
