"""``python -m opefo_trl.methods``: the README's methods table, from the method classes."""

from opefo_trl.methods import methods_table

print(methods_table())
