"""The request contract shared by the gateway and both engines: one typed declaration of every field
(name, type, range, default). Engine-free: it imports pydantic only, so the gateway can use it."""
