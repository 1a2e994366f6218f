# vLLM's own engine on the tiny llava fixture, speculators and the shim not involved.
import sys, traceback
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    d = sys.argv[1]
    try:
        llm = LLM(model=d, enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=4,
                  limit_mm_per_prompt={"image": 1})
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=2, temperature=0.0))
        print("RESULT OK", out[0].outputs[0].token_ids)
    except Exception as e:
        print("RESULT FAIL", type(e).__name__, str(e)[:300])
        traceback.print_exc(limit=3)
