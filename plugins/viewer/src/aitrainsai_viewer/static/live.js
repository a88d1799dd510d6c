// A live run: whenever the ledger changes, fetch only the parts of this page whose stamp changed (the server
// answers with those alone, or nothing) and swap them in; stop when the run ends.
(function () {
  var body = document.body, url = body.dataset.stream;
  if (!url || !window.EventSource) return;
  var source = new EventSource(url + "?since=" + encodeURIComponent(body.dataset.since || ""));
  var busy = false, queued = null;  // queued: null, or whether the refresh asked for meanwhile is the last
  function refresh(last) {
    if (busy) { queued = queued === true || last; return; }
    busy = true;
    var stamps = {};
    document.querySelectorAll("section[data-part]").forEach(function (part) {
      stamps[part.dataset.part] = part.dataset.stamp;
    });
    var address = new URL(location.href);
    address.searchParams.set("parts", JSON.stringify(stamps));
    fetch(address, {cache: "no-store"}).then(function (r) { return r.status === 200 ? r.text() : ""; })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        fresh.querySelectorAll("section[data-part]").forEach(function (part) {
          var old = document.querySelector('section[data-part="' + part.dataset.part + '"]');
          if (old) old.replaceWith(document.importNode(part, true));
        });
        if (last) { var badge = document.getElementById("live"); if (badge) badge.remove(); }
      })
      .finally(function () {
        busy = false;
        if (queued !== null) { var next = queued; queued = null; refresh(next); }
      });
  }
  source.addEventListener("change", function () { refresh(false); });
  source.addEventListener("end", function () { source.close(); refresh(true); });
  source.addEventListener("failed", function () { source.close(); });
})();
