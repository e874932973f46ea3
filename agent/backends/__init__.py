"""The engines the agent can run for an instance: the bundled dctl engine, vLLM, SGLang or any
OpenAI-compatible server (`protocol.engine_kinds`), each turned into a `LaunchPlan` (`launch`),
checked for presence before a start (`presence`), fronted by the key-checking proxy where it
checks no key itself (`fronted`, `key_proxy`), and read through its metrics (`metric_names`)."""
