// A TCP port on the loopback interface that no one listens on now (the kernel's pick), for
// a rendezvous whose port the user left to kiln (`kiln launch`, the collective tests).
// Another process may take it before it is bound again: callers that can, retry.
#pragma once

namespace kiln::dist {

// Throws "[launch] cannot pick a free port: ..." when the kernel gives none.
int free_loopback_port();

}  // namespace kiln::dist
