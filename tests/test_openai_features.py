"""The OpenAI/vLLM request features beyond plain sampling, end to end against a live colocated
`shuttle serve` with the official `openai` client: echo + logprobs and vLLM's prompt_logprobs
(equal to transformers' log-softmax), logit_bias, /tokenize and /detokenize, max_model_len."""
import httpx
import openai
import pytest
import torch

from clients.live_server import LiveServer
from tests.test_sampling_features import reference_prompt_logprobs

pytestmark = pytest.mark.slow
IDS = [5, 17, 33, 100, 250, 7, 9, 11, 13, 200]


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    with LiveServer(["--model", str(ckpt), "--served-model-name", "tiny", "--colocated"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_echo_with_logprobs_gives_the_prompts_logprobs(ckpt, client):
    want = reference_prompt_logprobs(ckpt, IDS)
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(IDS) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:len(IDS)]), want, atol=1e-4, rtol=0)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    stream = client.completions.create(model="tiny", prompt=IDS, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                       stream=True)
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    torch.testing.assert_close(torch.tensor(streamed[1:]), torch.tensor(lp.token_logprobs[1:]), atol=1e-5, rtol=0)
    # text_offset runs on across the chunks (vLLM's), as in the whole response
    stream = client.completions.create(model="tiny", prompt=IDS, max_tokens=5, temperature=0, echo=True, logprobs=1,
                                       stream=True)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert len(chunks) > 2
    whole = client.completions.create(model="tiny", prompt=IDS, max_tokens=5, temperature=0, echo=True, logprobs=1)
    assert [o for c in chunks for o in c.text_offset] == whole.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs(ckpt, client):
    want = reference_prompt_logprobs(ckpt, IDS)
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=2, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(IDS)
    torch.testing.assert_close(torch.tensor([plp[i][str(IDS[i])]["logprob"] for i in range(1, len(IDS))]), want,
                               atol=1e-4, rtol=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1


def test_logit_bias(server, client):
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=5, temperature=0.8,
                                  logit_bias={"77": 100})
    base = client.completions.create(model="tiny", prompt=IDS, max_tokens=1, temperature=0, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": first, "add_special_tokens": False})
    banned = {str(t): -100 for t in tok.json()["tokens"]}
    other = client.completions.create(model="tiny", prompt=IDS, max_tokens=1, temperature=0, logit_bias=banned)
    assert other.choices[0].text != base.choices[0].text
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": [77] * 5}).json()
    assert r.choices[0].text == detok["prompt"]


@pytest.mark.parametrize("bias,param", [({"x": 1}, "logit_bias"), ({"3": 200}, "logit_bias"),
                                        ({"999999": 1}, "logit_bias")])
def test_bad_logit_bias_is_a_400(server, bias, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_detokenize_and_max_model_len(server, ckpt):
    models = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert models["max_model_len"] == 512
    t = httpx.post(f"{server.url}/tokenize", json={"prompt": "The for statement", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) > 0 and t["max_model_len"] == 512
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"].strip() == "The for statement"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
