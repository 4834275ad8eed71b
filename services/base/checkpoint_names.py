"""The file names of a safetensors checkpoint directory, declared once: the model's loader and converters read and
write them, and the engines' HTTP processes (services/kit/local_files.py) check the shards an index names without
importing the model."""

INDEX_FILE = "model.safetensors.index.json"   # {"weight_map": {tensor key: shard file}}
SINGLE_FILE = "model.safetensors"             # a checkpoint of one shard, without an index
