// Live updates for a list a reviewer watches: the element with data-poll is refreshed from that
// address every data-every seconds, and a polite status line says when the count changes.
// Without JavaScript the page works as is (reload to refresh).
(function () {
  "use strict";
  var list = document.querySelector("[data-poll]");
  if (!list || !window.fetch) { return; }
  var url = list.getAttribute("data-poll");
  var every = (parseInt(list.getAttribute("data-every"), 10) || 3) * 1000;
  var status = document.getElementById("live-status");
  var last = null;

  function count() {
    var node = list.querySelector("[data-count]");
    return node ? parseInt(node.getAttribute("data-count"), 10) : 0;
  }

  function say(text) { if (status) { status.textContent = text; } }

  function tick() {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        if (html !== last) {
          var before = count();
          list.innerHTML = html;
          last = html;
          var after = count();
          if (after !== before) { say(after > before ? "New entries arrived." : "The list changed."); }
        }
        setTimeout(tick, every);
      })
      .catch(function () {
        say("Live updates stopped: reload the page.");
      });
  }

  setTimeout(tick, every);
})();
