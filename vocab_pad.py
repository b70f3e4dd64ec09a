"""Model embedding (600) larger than the tokenizer (512), as in Qwen checkpoints: generated ids >= 512."""
import httpx
U = "http://127.0.0.1:18732"
M = "other_model_vocab"
r = httpx.post(U + "/v1/chat/completions", timeout=60, json={"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "seed": 0})
msg = r.json()["choices"][0]["message"]; g = msg["generation_token_ids"]
print("ids >= 512 generated:", [t for t in g if t >= 512], "content:", repr(msg["content"][:60]))
r = httpx.post(U + "/v1/chat/completions", timeout=60, json={"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "seed": 0, "logprobs": True})
print("logprobs=true:", r.status_code, r.text[:300])
r = httpx.post(U + "/v1/chat/completions", timeout=60, json={"model": M, "messages": [{"role": "user", "content": "hi"}, msg, {"role": "user", "content": "more"}], "max_tokens": 3})
print("send back:", r.status_code, r.text[:300])
r = httpx.post(U + "/v1/completions", timeout=60, json={"model": M, "prompt": g, "max_tokens": 3})
print("completions with those ids:", r.status_code, r.text[:300])
