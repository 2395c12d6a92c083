"""The ground floor: what every floor may import (the refusal type every rule owner returns)."""
