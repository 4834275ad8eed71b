"""The understanding service's HTTP routes, one router per audience: chat (OpenAI), native (LightLLM-style
/generate), internal (the gateway's image-prefix calls), ops (health, metrics, models)."""
