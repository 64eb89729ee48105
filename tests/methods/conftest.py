# The example method registers itself when imported: only its test imports it (and unregisters it afterwards).
collect_ignore = ["example_method.py"]
