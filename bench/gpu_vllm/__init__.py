"""The steps of `bench/gpu_vllm_backend.py`: `report` (verdicts and the summary), `checkpoint`
(the tiny Llama and its load check), `stack` (control plane, agent, gateway on loopback; the
deployment), `checks` (what is asked of the running instance)."""
