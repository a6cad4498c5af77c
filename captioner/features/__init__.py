"""The feature cache: images encoded once by a frozen encoder (``cache``), its storage dtype (``dtype``) and its lock (``lock``)."""
