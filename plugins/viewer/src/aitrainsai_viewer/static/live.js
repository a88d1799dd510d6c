// A live run: swap in the page's new content whenever the ledger changes; stop when the run ends.
(function () {
  var body = document.body, url = body.dataset.stream;
  if (!url || !window.EventSource) return;
  var source = new EventSource(url + "?since=" + encodeURIComponent(body.dataset.since || ""));
  function refresh(last) {
    fetch(location.href, {cache: "no-store"}).then(function (r) { return r.text(); }).then(function (html) {
      var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
      if (fresh) document.getElementById("content").innerHTML = fresh.innerHTML;
      if (last) { var badge = document.getElementById("live"); if (badge) badge.remove(); }
    });
  }
  source.addEventListener("change", function () { refresh(false); });
  source.addEventListener("end", function () { source.close(); refresh(true); });
  source.addEventListener("failed", function () { source.close(); });
})();
