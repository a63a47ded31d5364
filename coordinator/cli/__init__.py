"""Every ``overnight`` command: parsing only, the logic lives in the packages beside this one."""
