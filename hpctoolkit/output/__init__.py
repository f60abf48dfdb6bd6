"""What people read: the `[hpctoolkit...]` lines and the launcher's console (`console`), and how a
figure rounds on them (`figures`). Pure standard library. Import the names from their modules;
this package init imports nothing.
"""
