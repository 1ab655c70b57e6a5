"""The OpenAI request shapes and what they become for the engine, shared by the HTTP API and
the offline batch command (neither depends on the other): the schemas, their checks against a
model's limits, the OmniRequest builders, and the error envelope."""
