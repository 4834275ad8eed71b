"""The gateway's routes, one module per concern: chat, images, ops (health, metrics, models)."""
