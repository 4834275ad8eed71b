"""Hard limits and defaults declared once. Operators may tighten some of them (gateway flags), never widen."""
from __future__ import annotations

SEED_MAX = 2**63 - 1              # torch.Generator.manual_seed takes int64
MAX_IMAGES_PER_REQUEST = 4        # n, and edit inputs
MAX_STEPS = 1000
MAX_GUIDANCE = 30.0
MAX_THINK_TOKENS = 4096
DEFAULT_THINK_TOKENS = 1024
IMAGE_BLOCK = 32                  # pixels per image-token side
MAX_IMAGE_SIDE = 4096             # U1.5 is trained up to 4096^2
DEFAULT_IMAGE_SIDE = 2048         # the server's default size is DEFAULT_IMAGE_SIDE^2 (the model's native area)
# The size table: the default size, the 8-step preset's 1024², and 16:9 / 9:16 at the default area (what the
# gateway's aspect_ratio gives). The generation engine warms each before it reports ready (warmup.py).
SIZE_TABLE = ((2048, 2048), (1024, 1024), (2720, 1536), (1536, 2720))
MIN_IMAGE_SIDE = 32
MAX_PROMPT_CHARS = 16384
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 256

# chat sampling (OpenAI / vLLM conventions)
GREEDY_TEMPERATURE = 1e-5         # below this a temperature means greedy (vLLM's epsilon)
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0             # presence / frequency
MAX_TOP_LOGPROBS = 20
MAX_CHAT_CHOICES = 16             # n of a chat request
MAX_LOGIT_BIAS = 100.0            # |bias| (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024

# images: live previews (OpenAI's partial_images) and interleaved text-and-image answers
MAX_PARTIAL_IMAGES = 3            # OpenAI's range 0..3
MAX_INTERLEAVE_IMAGES = 16
DEFAULT_INTERLEAVE_IMAGES = 10    # the official interleave_gen's cap
DEFAULT_INTERLEAVE_TOKENS = 8192  # the official interleave_gen's max_new_tokens

# JSON bodies
MAX_JSON_DEPTH = 32
MAX_JSON_ELEMENTS = 200_000       # values in one body (counted as commas + brackets + braces, before parsing)

# chat conversations
MAX_CHAT_MESSAGES = 4096
MAX_CONTENT_PARTS = 256           # parts of one message

# input images (chat image parts, edit inputs): one declaration for the gateway and understanding, both of which
# check them from the image header before any pixel is decoded
INPUT_IMAGE_FORMATS = ("png", "jpeg", "webp")
MAX_INPUT_IMAGE_BYTES = 20 * 1024 * 1024          # encoded size of one image
MAX_INPUT_IMAGE_PIXELS = 4096 * 4096              # one image (header width x height)
MAX_INPUT_REQUEST_PIXELS = 32 * 1024 * 1024       # all input images of one request
MAX_CHAT_IMAGES = 16                              # image parts of one chat request
MAX_LORA_NAME_CHARS = 256       # a LoRA adapter name (a `model` value, docs/lora.md)
MAX_LORA_STRENGTH = 100.0       # |scale| of an adapter's product (a loaded adapter, or a weight update's delta)
