"""The feature cache: images encoded once by a frozen encoder (``cache``), its storage dtype (``dtype``); the cache module also holds its keys, file layout, write lock and row reader."""
